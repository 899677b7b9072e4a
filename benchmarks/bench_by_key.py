"""What the statistics by a per-token key cost next to the mismatch monitor, on the same [B, T] tensors.

Baseline: ``MismatchMonitor.update`` on the device's default path (the CPU: eager torch; CUDA: one Triton kernel),
which every measured batch pays. Ours: ``KeyedStats(<keying>).update`` for the keyings the pipeline adds per batch
or per loss pass (``position`` with ``by_position``, ``lag`` with the staleness split, ``turn`` on multi-turn
batches) and ``prob`` (the monitor's probability buckets with all five statistics). Each call is timed to the end
of a device synchronisation (an update only queues GPU work), in interleaved rounds (monitor, position, lag, ...),
so a slow spell of a shared machine hits them all; reported: the median and spread of each, and each keyed
update's median as a ratio of the monitor update's. No goal: the figure says what turning a keying on costs.

    python -m benchmarks.bench_by_key [--quick] [--device cuda] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks._common import spread, write_results
from tim_plugins.by_key import KeyedStats, lag_keys, position_keys
from tim_plugins.metrics import MismatchMonitor


def _tensors(B: int, T: int, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g) * 4.0
    train = rollout + 0.02 * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.9
    version = torch.randint(0, 4, (B,), generator=g)
    turn = (torch.arange(T) // max(T // 4, 1)).expand(B, T)
    return [x.to(device) for x in (rollout, train, mask, version, turn)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 gives stable ratios)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rollout, train, mask, version, turn = _tensors(args.batch, args.length, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    monitor = MismatchMonitor()
    keyed = {name: KeyedStats(name) for name in ("position", "lag", "turn", "prob")}
    candidates = {
        "monitor": lambda: monitor.update(rollout, train, mask),
        "position": lambda: keyed["position"].update(rollout, train, mask, position_keys(mask)),
        "lag": lambda: keyed["lag"].update(rollout, train, mask, lag_keys(4, version, mask.shape)),
        "turn": lambda: keyed["turn"].update(rollout, train, mask, turn),
        "prob": lambda: keyed["prob"].update(rollout, train, mask, rollout),
    }
    for fn in candidates.values():  # warm-up
        for _ in range(2):
            fn()
    repeats = 5 if args.quick else 15
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
        monitor.reset()
        for stats in keyed.values():
            stats.reset()
    seconds = {name: spread(ts) for name, ts in times.items()}
    base = seconds["monitor"]["median"]
    results = {
        "shape": [args.batch, args.length],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "monitor_path": "kernel" if device.type == "cuda" and not monitor._kernel_failed else "eager",
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "seconds": seconds,
        # a keyed update's median time / the monitor update's
        "ratios": {f"{name}_vs_monitor": seconds[name]["median"] / base for name in keyed},
    }
    name = "by_key" if device.type == "cpu" else f"by_key_{device.type}"
    path = write_results(name, results)
    print(f"[{results['device']}] monitor update {base * 1e3:.3f} ms; "
          + "; ".join(f"{n} {seconds[n]['median'] * 1e3:.3f} ms ({results['ratios'][n + '_vs_monitor']:.2f}x)"
                      for n in keyed) + f" -> {path}")
    return results


if __name__ == "__main__":
    main()
