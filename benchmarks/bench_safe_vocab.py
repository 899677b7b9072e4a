"""Safe-vocab hidden-state head vs TRL 1.16's fused chunked log-prob and plain full-logits log_softmax (fwd + bwd).

Variants (same inputs; loss = Σ log-probs, backward to the hidden states and the lm_head weight):
  ours   ``tim_plugins.safe_vocab.safe_logprobs_from_hidden(min_p=DEFAULT_MIN_P)`` as users get it: on CUDA the
         Triton folds (883 rows per forward GEMM at V = 151,936; TRL's 4096 × 32768 tiles in backward), elsewhere
         the torch folds; buffers of at most TRL's tile bytes either way
  torch  the same with ``backend="torch"``: the torch folds, ``default_chunk_rows(V, dtype)`` rows per chunk (706
         in fp32, 325 in bf16 at V = 151,936); on CPU the same code as ``ours``
  trl    ``trl.kernels.chunked_logprob.ChunkedLogProbFunction`` (what ``add_fused_lm_head`` runs) with TRL's own
         vocabulary tile ``_CHUNKED_LOGPROB_CHUNK_SIZE`` (32768) × ``TOKEN_CHUNK_SIZE`` (4096) rows. On CUDA its
         per-tile folds are Triton kernels (one pass over each tile in the compute dtype; backward writes the
         logits gradient into the tile and runs bf16 GEMMs with fp32 outputs); on CPU the same folds in torch
  naive  ``log_softmax((hidden @ weight.T).float())`` + gather: full [N, V] logits, skipped where the estimate
         of its memory exceeds what is free
  base   (``--baseline FILE``) ``safe_logprobs_from_hidden`` of another copy of ``tim_plugins/safe_vocab.py``
         (e.g. the previous commit's), to measure a change against the old code in the same run

Method. Per case (dtype, H, N) the variants run interleaved in one process (A B C, B C A, C A B, ...: rounds in
rotated order), after ``--warmup`` unrecorded rounds (CUDA: Triton JIT, cuBLAS heuristics; CPU: first-touch
costs), and every step is timed on its own (CUDA: synchronised before and after; the forward is timed too; CPU:
the process CPU time too). Peak memory per step: on CUDA ``max_memory_allocated`` after
``reset_peak_memory_stats`` (the caching allocator counts live tensors, so blocks an earlier variant left cached
do not hide a later one's allocations); on CPU the process's resident high-water mark, reset before each step
(``/proc/self/clear_refs``; glibc is told to mmap every allocation of 1 MiB or more and unmap it on free, so an
earlier variant's freed memory is not silently reused). "extra" = peak − memory in use before the step (the
inputs: gradients are dropped between steps). Ratios: median of ours / median of trl, and the per-round paired
ratios for their spread. Sanity check: ours and trl log-probs and gradients against a float64 reference of each
rule (safe set / full vocabulary) on the logits as rounded by the compute dtype.
Goals (issue 25): ours / trl time <= 1.10 and peak memory <= 1.0; naive / ours peak >= 4.

    python -m benchmarks.bench_safe_vocab [--device cuda] [--quick] [--case DTYPE:H:N[:REPEATS] ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import spread, write_results

QWEN_V = 151936
GOALS = {"time_ours_over_trl": 1.10, "peak_ours_over_trl": 1.0, "naive_over_ours_peak": 4.0}
# (dtype, hidden, rows) per device; the GPU grid, and what a shared 2-core CPU runs in minutes
DEFAULT_CASES = {
    "cuda": [("bf16", h, n) for h in (896, 2048, 4096) for n in (4096, 16384, 65536)],
    "cpu": [("fp32", 896, 256), ("fp32", 896, 1024), ("bf16", 896, 128)],
}
QUICK_CASES = [("fp32", 64, 96), ("bf16", 64, 96)]
QUICK_VOCAB = 5003  # odd on purpose
LOGIT_STD = 4.0  # logits of std 4 (max ~ 4.4 std at V 150k): min_p = 1e-5 then prunes a real tail
# Per-dtype tolerances of the sanity check: log-prob max abs error as a multiple of the largest |logit|
# (bf16: about one unit in the last place, in case a GEMM tiling rounds a logit differently from the
# reference's), gradient max abs error relative to the largest reference entry.
CHECK_TOL = {"fp32": (1e-6, 1e-3), "bf16": (2 ** -7, 3e-2), "fp16": (2 ** -10, 4e-3)}


def _dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


# ---------------------------------------------------------------------------------------------- measuring
class _CudaMeter:
    def __init__(self, device):
        import torch

        self.torch, self.device = torch, device

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.device)

    def start(self) -> float:
        self.sync()
        self.torch.cuda.reset_peak_memory_stats(self.device)
        return self.torch.cuda.memory_allocated(self.device) / 2**20

    def peak(self) -> float:
        self.sync()
        return self.torch.cuda.max_memory_allocated(self.device) / 2**20

    def free_mb(self) -> float:
        return self.torch.cuda.mem_get_info(self.device)[0] / 2**20


def _proc_status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


class _CpuMeter:
    def __init__(self):
        _mmap_large_allocations()
        self.resettable = True
        try:
            self._reset()
            _proc_status_mb("VmHWM")
        except OSError:
            self.resettable = False  # peaks then come out as None: only times are measured

    @staticmethod
    def _reset() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the resident high-water mark (VmHWM) to the current RSS

    def sync(self) -> None:
        pass

    def start(self) -> float:
        if self.resettable:
            self._reset()
        return _proc_status_mb("VmRSS")

    def peak(self) -> float | None:
        return _proc_status_mb("VmHWM") if self.resettable else None

    def free_mb(self) -> float:
        return _meminfo_mb("MemAvailable")


def _mmap_large_allocations(threshold: int = 1 << 20) -> None:
    """glibc: serve every allocation >= 1 MiB by mmap and unmap it on free (M_MMAP_THRESHOLD, which also stops
    glibc from raising the threshold after big frees), so memory an earlier step freed is not reused unseen
    by the resident-set peak of the next one."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, threshold)  # M_TRIM_THRESHOLD: give the heap's free top back too
    except (OSError, AttributeError):
        pass  # not glibc: peaks may then undercount reused memory


def _meminfo_mb(key: str) -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("inf")


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


# ---------------------------------------------------------------------------------------------- variants
def load_safe_vocab(path: str | None):
    """The module under test: ``tim_plugins.safe_vocab``, or another copy of it (``--baseline``)."""
    if path is None:
        import tim_plugins.safe_vocab as mod

        return mod
    import tim_plugins  # noqa: F401  (the copy's relative imports resolve inside this package)

    spec = importlib.util.spec_from_file_location("tim_plugins._bench_baseline_safe_vocab", path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "tim_plugins"
    spec.loader.exec_module(mod)
    return mod


def make_forward(variant: str, hidden, weight, tokens, modules: dict):
    """A closure computing the [N] fp32 log-probs of ``variant`` (autograd graph to hidden and weight)."""
    import torch

    if variant in ("ours", "base"):
        mod = modules[variant]

        def fwd():
            return mod.safe_logprobs_from_hidden(hidden, weight, tokens, min_p=mod.DEFAULT_MIN_P).logprobs
    elif variant == "torch":
        mod = modules["ours"]

        def fwd():
            return mod.safe_logprobs_from_hidden(hidden, weight, tokens, min_p=mod.DEFAULT_MIN_P,
                                                 backend="torch").logprobs
    elif variant == "trl":
        # hooks.TRL_SOURCES trl.trainer.utils:_ChunkedLogProbFunction (this class, re-exported there) and
        # BENCHMARK_SOURCES trl.trainer.utils:_CHUNKED_LOGPROB_CHUNK_SIZE: the kernel add_fused_lm_head runs
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        def fwd():
            return ChunkedLogProbFunction.apply(hidden, weight, None, tokens, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None,
                                                1.0, ())[0]
    elif variant == "naive":
        def fwd():
            logits = (hidden @ weight.t()).float()
            return torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    else:
        raise ValueError(f"variant={variant!r}: expected ours, torch, trl, naive or base")
    return fwd


def make_inputs(n: int, h: int, v: int, dtype_name: str, device, seed: int = 0):
    """hidden [N, H] ~ N(0, 1) (post-norm scale), weight [V, H] with logits of std ``LOGIT_STD``, tokens [N]."""
    import torch

    dtype = _dtype(dtype_name)
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen, device=device) * (LOGIT_STD / math.sqrt(h))).to(dtype)
    tokens = torch.randint(0, v, (n,), generator=gen, device=device)
    return hidden, weight.requires_grad_(), tokens


def naive_bytes(n: int, v: int, dtype_name: str) -> int:
    """Estimated peak bytes of the naive variant: logits in dtype, fp32 copy, log_softmax output, their grads."""
    s = _dtype(dtype_name).itemsize
    return n * v * (2 * s + 3 * 4)


# ---------------------------------------------------------------------------------------------- sanity
def sanity_check(dtype_name: str, h: int, v: int, n: int, device, modules: dict) -> dict:
    """ours, torch and trl vs float64 references of their rules on the same inputs (log-probs and gradients).

    Reference: z = hidden @ weight.T in the compute dtype (as both implementations round it), then in float64
    the safe set S = {p >= min_p · max p} (ours) or the full vocabulary (trl), log q over it, and the closed-form
    gradient of Σ log q(token): G = onehot − q, dL/dhidden = G W, dL/dweight = Gᵀ hidden.
    """
    import torch

    hidden, weight, _ = make_inputs(n, h, v, dtype_name, device, seed=1)
    with torch.no_grad():
        z = (hidden @ weight.t()).double()
        gen = torch.Generator(device=device).manual_seed(2)
        # tokens as a sampler emits them: drawn from softmax(z), so most lie in the safe set
        tokens = torch.multinomial(torch.softmax(z, -1), 1, generator=gen).squeeze(-1)
        min_p = modules["ours"].DEFAULT_MIN_P
        p = torch.softmax(z, -1)
        keep = p >= min_p * p.amax(-1, keepdim=True)
        refs = {}
        for name, mask in (("ours", keep), ("trl", None)):  # ("torch": the rule of "ours")
            zz = z if mask is None else z.masked_fill(~mask, -math.inf)
            logq = torch.log_softmax(zz, -1)
            g = -logq.exp()
            g.scatter_add_(-1, tokens[:, None], torch.ones_like(g[:, :1]))
            refs[name] = (logq.gather(-1, tokens[:, None]).squeeze(-1), g @ weight.double(), g.t() @ hidden.double())
        in_safe_ref = keep.gather(-1, tokens[:, None]).squeeze(-1)
        # a token within two units in the last place of the threshold may fall on either side: each variant's
        # GEMM tiles differ from the reference's, and cuBLAS rounds some logits differently for another shape
        z_tok = z.gather(-1, tokens[:, None]).squeeze(-1)
        tau = z.amax(-1) + math.log(min_p)
        at_boundary = (z_tok - tau).abs() <= 2 * torch.finfo(_dtype(dtype_name)).eps * torch.maximum(
            z_tok.abs(), tau.abs())
        zmax = float(z.abs().max())
    lp_tol, g_tol = CHECK_TOL[dtype_name]
    out = {"dtype": dtype_name, "hidden": h, "vocab": v, "n": n, "max_abs_logit": zmax,
           "tolerance": {"logprob_abs": lp_tol * zmax, "grad_rel": g_tol}, "pruned_tokens_in_vocab_frac":
           float(1.0 - keep.double().mean())}
    refs["torch"] = refs["ours"]
    ok = True
    for name in ("ours", "torch", "trl"):
        hidden.grad = weight.grad = None
        lp = make_forward(name, hidden, weight, tokens, modules)()
        lp.sum().backward()
        ref_lp, ref_gh, ref_gw = refs[name]
        sel = in_safe_ref if name != "trl" else torch.ones_like(in_safe_ref)
        err_lp = float((lp.detach().double() - ref_lp)[sel].abs().max())
        err_gh = float((hidden.grad.double() - ref_gh).abs().max() / ref_gh.abs().max())
        err_gw = float((weight.grad.double() - ref_gw).abs().max() / ref_gw.abs().max())
        res = {"logprob_max_abs_err": err_lp, "grad_hidden_rel_err": err_gh, "grad_weight_rel_err": err_gw,
               "tokens_compared": int(sel.sum())}
        if name != "trl":
            ours = modules["ours"].safe_logprobs_from_hidden(hidden.detach(), weight.detach(), tokens, min_p=min_p,
                                                             backend="torch" if name == "torch" else "auto")
            differ = ours.in_safe != in_safe_ref
            res["in_safe_mismatches"] = int((differ & ~at_boundary).sum())
            res["in_safe_boundary_flips"] = int((differ & at_boundary).sum())
        res["passed"] = bool(err_lp <= lp_tol * zmax and max(err_gh, err_gw) <= g_tol
                             and res.get("in_safe_mismatches", 0) == 0)
        ok &= res["passed"]
        out[name] = res
    out["passed"] = ok
    return out


# ---------------------------------------------------------------------------------------------- driver
def run_case(dtype_name: str, h: int, n: int, v: int, variants: list[str], repeats: int, warmup: int, device,
             meter, modules: dict) -> dict:
    import torch

    case = {"dtype": dtype_name, "hidden": h, "vocab": v, "n": n, "repeats": repeats, "warmup": warmup,
            "chunk_rows_ours": modules["ours"].default_chunk_rows(v, _dtype(dtype_name), fused=device.type == "cuda"),
            "chunk_rows_torch": modules["ours"].default_chunk_rows(v, _dtype(dtype_name)), "variants": {}}
    active = []
    for name in variants:
        rec = {"times_s": [], "fwd_s": [], "cpu_s": [], "peak_mb": [], "extra_mb": []}
        if name == "naive":
            need = naive_bytes(n, v, dtype_name) / 2**20
            free = meter.free_mb()
            if device.type == "cpu" and dtype_name != "fp32":
                rec["skipped"] = "naive runs only in fp32 on CPU (half-precision [N, V] GEMMs take minutes here)"
            elif need > 0.8 * free:
                rec["skipped"] = f"estimated {need:.0f} MB > 0.8 × {free:.0f} MB free"
        case["variants"][name] = rec
        if "skipped" not in rec:
            active.append(name)
    hidden, weight, tokens = make_inputs(n, h, v, dtype_name, device)
    fwds = {name: make_forward(name, hidden, weight, tokens, modules) for name in active}
    for r in range(warmup + repeats):
        if not active:
            break
        # each round in a rotated order, so no variant always runs first (or right after the same one)
        for name in active[r % len(active):] + active[: r % len(active)]:
            rec = case["variants"][name]
            hidden.grad = weight.grad = None
            try:
                base = meter.start()
                t0, c0 = time.perf_counter(), time.process_time()
                lp = fwds[name]()
                meter.sync()
                t1 = time.perf_counter()
                lp.sum().backward()
                meter.sync()
                t2, c2 = time.perf_counter(), time.process_time()
                peak = meter.peak()
            except torch.OutOfMemoryError as exc:
                rec["skipped"] = f"out of memory: {str(exc).splitlines()[0][:200]}"
                active.remove(name)
                hidden.grad = weight.grad = lp = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            del lp
            if r >= warmup:
                rec["times_s"].append(t2 - t0)
                rec["fwd_s"].append(t1 - t0)
                rec["cpu_s"].append(c2 - c0)
                if peak is not None:
                    rec["peak_mb"].append(peak)
                    rec["extra_mb"].append(peak - base)
            print(f"  {dtype_name} H={h} N={n} {'warm-up' if r < warmup else f'round {r - warmup + 1}'} "
                  f"{name:5s} {t2 - t0:8.3f} s (fwd {t1 - t0:.3f})"
                  + (f", peak {peak:.0f} MB, extra {peak - base:.0f} MB" if peak is not None else ""), flush=True)
    hidden.grad = weight.grad = None
    del hidden, weight, tokens, fwds
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for rec in case["variants"].values():
        if rec["times_s"]:
            rec["time_s"] = spread(rec["times_s"])
            rec["fwd_time_s"] = spread(rec["fwd_s"])
            rec["cpu_time_s"] = spread(rec["cpu_s"])
        if rec["peak_mb"]:
            rec["peak_mb_median"] = statistics.median(rec["peak_mb"])
            rec["extra_mb_median"] = statistics.median(rec["extra_mb"])
    case["ratios"] = compare(case["variants"], device.type)
    return case


def _paired(a: list[float], b: list[float]) -> dict:
    return spread([x / y for x, y in zip(a, b)])


def compare(v: dict, device_type: str) -> dict:
    """Ratios of the medians, with the per-round paired ratios' spread (the rounds are interleaved). On CPU also
    of the process CPU time (all threads), which other jobs on a shared machine inflate far less than wall time."""
    out = {}
    ours = v.get("ours", {})
    if not ours.get("times_s"):
        return out
    for other, key in (("trl", "ours_over_trl"), ("base", "base_over_ours"), ("torch", "torch_over_ours")):
        rec = v.get(other, {})
        if not rec.get("times_s"):
            continue
        num, den = (ours, rec) if other == "trl" else (rec, ours)
        out[f"time_{key}"] = num["time_s"]["median"] / den["time_s"]["median"]
        out[f"time_{key}_paired"] = _paired(num["times_s"], den["times_s"])
        out[f"fwd_time_{key}"] = num["fwd_time_s"]["median"] / den["fwd_time_s"]["median"]
        if device_type == "cpu":
            out[f"cpu_time_{key}"] = num["cpu_time_s"]["median"] / den["cpu_time_s"]["median"]
            out[f"cpu_time_{key}_paired"] = _paired(num["cpu_s"], den["cpu_s"])
        if num.get("peak_mb") and den.get("peak_mb"):
            out[f"peak_{key}"] = num["peak_mb_median"] / den["peak_mb_median"]
            out[f"extra_{key}"] = num["extra_mb_median"] / den["extra_mb_median"]
    naive = v.get("naive", {})
    if naive.get("peak_mb") and ours.get("peak_mb"):
        out["naive_over_ours_peak"] = naive["peak_mb_median"] / ours["peak_mb_median"]
        out["naive_over_ours_extra"] = naive["extra_mb_median"] / ours["extra_mb_median"]
    if naive.get("times_s"):
        out["time_ours_over_naive"] = ours["time_s"]["median"] / naive["time_s"]["median"]
    return out


def _parse_case(text: str) -> tuple:
    parts = text.split(":")
    if len(parts) not in (3, 4) or parts[0] not in ("fp32", "bf16", "fp16"):
        raise argparse.ArgumentTypeError(f"--case {text!r}: expected DTYPE:H:N[:REPEATS] with DTYPE fp32|bf16|fp16, "
                                         "e.g. bf16:896:4096")
    try:
        nums = [int(x) for x in parts[1:]]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--case {text!r}: H, N and REPEATS must be integers") from None
    if min(nums) < 1:
        raise argparse.ArgumentTypeError(f"--case {text!r}: H, N and REPEATS must be >= 1")
    return (parts[0], *nums)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]")
    p.add_argument("--quick", action="store_true", help=f"tiny shapes (H 64, V {QUICK_VOCAB}), 2 repeats: the test")
    p.add_argument("--case", action="append", type=_parse_case, default=None,
                   help="DTYPE:H:N[:REPEATS], repeatable (default: the device's grid, see DEFAULT_CASES)")
    p.add_argument("--vocab", type=int, default=None, help=f"vocabulary size (default {QWEN_V}; quick {QUICK_VOCAB})")
    p.add_argument("--repeats", type=int, default=None, help="recorded rounds per case (default 5; quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="unrecorded rounds first (default 1; quick 0)")
    p.add_argument("--variants", nargs="+", default=None, choices=["ours", "torch", "trl", "naive"],
                   help="default: ours trl naive, and torch on CUDA (where ours runs the Triton folds)")
    p.add_argument("--baseline", default=None, help="another safe_vocab.py to run as variant 'base'")
    p.add_argument("--check-n", type=int, default=None, help="rows of the sanity check (0 = skip)")
    p.add_argument("--output", default=None, help="results path (default benchmarks/results/safe_vocab[_cuda].json)")
    args = p.parse_args(argv)

    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device")
    cases = args.case or (QUICK_CASES if args.quick else DEFAULT_CASES["cuda" if device.type == "cuda" else "cpu"])
    v = args.vocab or (QUICK_VOCAB if args.quick else QWEN_V)
    repeats = args.repeats or (2 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    chosen = args.variants or ["ours", "trl", "naive"] + (["torch"] if device.type == "cuda" else [])
    variants = ["ours", *[x for x in chosen if x != "ours"]] + (["base"] if args.baseline else [])
    modules = {"ours": load_safe_vocab(None)}
    if args.baseline:
        modules["base"] = load_safe_vocab(args.baseline)
    meter = _CudaMeter(device) if device.type == "cuda" else _CpuMeter()
    import trl.kernels.chunked_logprob as trl_kernels  # BENCHMARK_SOURCES trl.kernels.chunked_logprob:_use_triton

    results = {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_threads": torch.get_num_threads(),
        "trl_fold": "triton" if trl_kernels._use_triton(device) else "torch",
        "ours_fold": "triton" if (device.type == "cuda" and modules["ours"]._fused_by_default(
            torch.empty(0, device=device))) else "torch",
        "min_p": modules["ours"].DEFAULT_MIN_P, "logit_std": LOGIT_STD,
        "method": "interleaved rounds in rotated order in one process; per-step wall time (synchronised on "
                  "CUDA) and, on CPU, process CPU time; peak = CUDA max_memory_allocated after "
                  "reset_peak_memory_stats, or CPU VmHWM after clear_refs; extra = peak - memory in use before "
                  "the step (inputs)",
        "peak_memory_measured": meter.peak() is not None if device.type == "cpu" else True,
        "baseline_file": args.baseline, "load_avg_start": os.getloadavg(), "uptime_start": _uptime(),
        "cases": [], "ratios": {}, "goals": {k: (f">= {g}" if k.startswith("naive") else f"<= {g}")
                                          for k, g in GOALS.items()},
        "quick": bool(args.quick),
    }
    name = "safe_vocab" + ("_cuda" if device.type == "cuda" else "") + ("_quick" if args.quick else "")
    print(f"safe-vocab benchmark on {results['device_name']} (TRL folds: {results['trl_fold']}), V={v}, "
          f"{repeats} rounds + {warmup} warm-up, variants {variants}; {results['uptime_start']}", flush=True)
    for dtype_name, h, n, *rep in cases:
        case = run_case(dtype_name, h, n, v, variants, rep[0] if rep else repeats, warmup, device, meter, modules)
        results["cases"].append(case)
        results["ratios"][f"{dtype_name}_H{h}_N{n}"] = {
            k: val for k, val in case["ratios"].items() if not isinstance(val, dict)}
        print(f"  -> {json.dumps(results['ratios'][f'{dtype_name}_H{h}_N{n}'])}", flush=True)
        results["meets"] = _meets(results["ratios"])
        save(name, results, args.output, complete=False)  # a run cut short keeps the cases it finished
    check_n = args.check_n if args.check_n is not None else (
        min(c[2] for c in cases) if args.quick else (min(1024, min(c[2] for c in cases))
                                                     if device.type == "cuda" else 128))
    if check_n:
        results["check"] = [sanity_check(dt, cases[0][1], v, check_n, device, modules)
                            for dt in sorted({c[0] for c in cases})]
        print("  sanity check: " + json.dumps(results["check"]), flush=True)
    results["meets"] = _meets(results["ratios"])
    results["load_avg_end"] = os.getloadavg()
    results["uptime_end"] = _uptime()
    print(f"wrote {save(name, results, args.output, complete=True)}")
    return results


def save(name: str, results: dict, output: str | None, *, complete: bool) -> Path:
    """Write the results (``complete`` False while cases remain) to ``output`` or benchmarks/results/NAME.json."""
    results["complete"] = complete
    return write_results(name, results, output)


def _meets(ratios: dict) -> dict:
    out = {}
    for case, r in ratios.items():
        m = {}
        if "time_ours_over_trl" in r:
            m["time"] = r["time_ours_over_trl"] <= GOALS["time_ours_over_trl"]
        if "peak_ours_over_trl" in r:
            m["peak"] = r["peak_ours_over_trl"] <= GOALS["peak_ours_over_trl"]
        if "naive_over_ours_peak" in r:
            m["naive_peak"] = r["naive_over_ours_peak"] >= GOALS["naive_over_ours_peak"]
        out[case] = m
    return out


if __name__ == "__main__":
    res = main()
    # a failed sanity check is an error (the results are written first, with the errors in them)
    sys.exit(0 if all(c["passed"] for c in res.get("check", [])) else 2)
