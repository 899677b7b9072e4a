"""One rank of tests/test_trl_vllm_server.py's two-process runs: TRL's GRPOTrainer in vLLM server mode on the toy
model, CPU, launched twice by ``torch.distributed.run`` (gloo), against the test's `trl vllm-serve` server, with the
weight transfer of tests/trl_server_client.py (the main process alone holds TRL's client and pushes the weights).

Run by the test (bounded, in its own process group), never collected by pytest. ``--config`` names the
configurations (comma-separated), each its own trainer and ``train()`` in the same two processes, from the
checkpoint's weights on the server:
- ``healthy``: every sync reaches the server; ``TIMConfig()``;
- ``stale``: no sync reaches the server (learning rate 1e-2); ``TIMConfig(parity_probe=True, action="stop")``;
- ``reference_failed``: as ``healthy``, but the server probe's first scoring request (its reference) fails on the main
  process (a dropped connection, raised around TRL's own ``VLLMClient.get_sequence_logprobs``);
- ``safe_vocab``: as ``healthy`` with ``TIMConfig(safe_vocab=True)`` (against a server whose own min-p processor
  makes the cut: the main process alone reads it, every rank must cut there).
Each rank writes ``rank_<r>.json`` under ``--out``/CONFIG: the optimizer steps it ran, the causes its pipeline named
(code, step, message), the probe's scorings on this rank and its judged figures (the main process's), its counted
problems, the logged ``tim/cause/named`` per step, the safe vocabulary's min-p (``safe_min_p``) and the audit's
error codes its causes read (``audit_codes``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from trl_server_client import patch_client, reload_checkpoint

CONFIGS = ("healthy", "stale", "reference_failed", "safe_vocab")
STALE_LR = 1e-2  # as tests/test_trl_callback.py: a step moves the toy policy well past the numerics


def _reward(completions, **kwargs):
    return [float(len(c)) / 10.0 for c in completions]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--server", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    configs = args.config.split(",")
    if any(c not in CONFIGS for c in configs):
        sys.exit(f"--config {args.config!r}: comma-separated names of {CONFIGS}")

    import torch.distributed as dist

    for config in configs:
        _train(args, config, Path(args.out) / config)
    dist.destroy_process_group()


def _train(args, config: str, out: Path) -> None:
    import datasets
    import torch.distributed as dist
    from trl import GRPOConfig, GRPOTrainer

    from tim_plugins.integrations.trl import TIMCallback, TIMConfig
    from tim_plugins.toy_model import synthetic_prompts

    rank = int(os.environ["RANK"])
    (out / "weights").mkdir(parents=True, exist_ok=True)
    if rank == 0:
        reload_checkpoint(args.server, args.model)
    synced: list[int] = []
    patch_client(setattr, out / "weights", synced, reload=config != "stale")
    grpo = GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, max_steps=args.steps, logging_steps=1, report_to=[], save_strategy="no",
        gradient_checkpointing=False, learning_rate=STALE_LR if config == "stale" else 1e-3, seed=0,
        disable_tqdm=True, loss_type="grpo", use_vllm=True, vllm_mode="server", vllm_server_base_url=args.server,
        vllm_server_timeout=60)
    ds = datasets.Dataset.from_dict({"prompt": synthetic_prompts(64)})
    trainer = GRPOTrainer(model=args.model, reward_funcs=_reward, args=grpo, train_dataset=ds)
    options = {"stale": {"parity_probe": True, "parity_probe_options": {"action": "stop"}},
               "safe_vocab": {"safe_vocab": True}}.get(config, {})
    cb = TIMCallback(trainer, TIMConfig(**options))
    trainer.add_callback(cb)
    requests_sent: list[int] = []
    with _first_scoring_fails(requests_sent, active=config == "reference_failed"):
        trainer.train()
    probe = cb.server_probe
    result = {
        "rank": rank, "world_size": dist.get_world_size(), "global_step": trainer.state.global_step,
        "safe_min_p": cb.truncation.min_p if cb.truncation is not None else None,
        "audit_codes": sorted(cb.pipeline.causes.audit_codes),
        "synced": synced, "causes": [(c.code, c.step, c.message) for c in cb.pipeline.causes.named],
        "probe_scorings": len(probe.seconds) if probe is not None else None,
        "probe_history": probe.probe.history if probe is not None else None,
        "diag": dict(cb.pipeline.diag),
        "probe_on": bool(probe.sequences) if probe is not None else None,
        "scoring_requests": len(requests_sent),
        "named_by_step": {h["step"]: h["tim/cause/named"] for h in trainer.state.log_history
                          if "tim/cause/named" in h},
    }
    (out / f"rank_{rank}.json").write_text(json.dumps(result, default=float))
    dist.barrier()  # neither rank runs ahead into the next configuration, or tears the group down under the other


@contextlib.contextmanager
def _first_scoring_fails(sent: list, active: bool):
    """Around TRL's own ``VLLMClient.get_sequence_logprobs`` (the server probe's scoring requests, main process):
    each request is counted in ``sent``; with ``active`` the first one fails as a dropped connection would."""
    from trl.generation.vllm_client import VLLMClient

    real = VLLMClient.get_sequence_logprobs

    def get_sequence_logprobs(self, *a, **k):
        sent.append(1)
        if active and len(sent) == 1:
            raise ConnectionError("the server dropped the connection (injected by the test)")
        return real(self, *a, **k)

    VLLMClient.get_sequence_logprobs = get_sequence_logprobs
    try:
        yield
    finally:
        VLLMClient.get_sequence_logprobs = real


if __name__ == "__main__":
    main()
