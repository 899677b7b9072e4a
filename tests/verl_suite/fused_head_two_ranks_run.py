"""One rank of tests/verl_suite/test_verl_fused_safe_vocab.py's two-rank test, launched twice by
``torch.distributed.run`` (gloo, CPU); never collected by pytest.

The toy model sharded by verl's own FSDP2 wrap (``verl.utils.fsdp_utils.apply_fsdp2``: each decoder layer, the
untied embedding and lm_head as units of their own, the root), and the engine's safe-vocabulary fused forward
(``_SafeFusedForward``, as the engine installs it for a ``use_fused_kernels`` micro-batch) on this rank's batch; one
backward. The same model unsharded, in this process, takes the mean of both ranks' losses: the data-parallel
gradient. Writes ``rank_<r>.json``: per parameter, the largest difference of the sharded run's gradient (gathered)
from that mean, and the same for the lm_head gathered with a bare ``full_tensor()`` (the engine's former gather).
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

VOCAB, BATCH, LENGTH = 383, 2, 12
NAMES = ("lm_head.weight", "model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM
    from verl.utils.fsdp_utils import apply_fsdp2

    from tim_plugins.integrations.verl import engine
    from tim_plugins.integrations.verl.engine import _SafeFusedForward
    from tim_plugins.patching import Patch
    from tim_plugins.truncation import Truncation

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model = copy.deepcopy(reference)
    apply_fsdp2(model, {"mesh": mesh}, {})
    truncation = Truncation(min_p=0.05)
    ids = torch.randint(2, VOCAB, (2, BATCH, LENGTH), generator=torch.Generator().manual_seed(3))  # rank k: ids[k]
    inputs = [{"input_ids": x, "attention_mask": torch.ones_like(x), "position_ids": torch.arange(LENGTH).expand(
        BATCH, LENGTH)} for x in ids]

    def loss(m, batch):
        m.forward = _SafeFusedForward(m, truncation, False, packed=False)  # an instance attribute, as the engine's
        return -m(**batch).log_probs.mean()

    (sum(loss(reference, batch) for batch in inputs) / 2).backward()  # the data-parallel mean, in one process
    want = dict(reference.named_parameters())
    loss(model, inputs[rank]).backward()
    got = dict(model.named_parameters())
    lm_head_class = type(got["lm_head.weight"]).__name__
    errors = {name: float((got[name].grad.full_tensor() - want[name].grad).abs().max()) for name in NAMES}
    # the former gather, a bare full_tensor() of the shard, through the same forward: the test's control
    model.zero_grad(set_to_none=True)
    patch = Patch(engine, "full_weight", lambda _: lambda w: w.full_tensor())
    try:
        loss(model, inputs[rank]).backward()
    finally:
        patch.undo()
    bare = float((got["lm_head.weight"].grad.full_tensor() - want["lm_head.weight"].grad).abs().max())
    result = {"rank": rank, "lm_head_class": lm_head_class, "errors": errors, "bare_full_tensor_error": bare,
              "scale": {name: float(want[name].grad.abs().max()) for name in NAMES}}
    (Path(args.out) / f"rank_{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
