"""The keep-your-settings checks that need a CUDA GPU (one prepared run on a lent device), three parts:

``fused``  The safe-vocabulary head (``safe_linear_logprobs``) against verl 0.9.1's own fused heads, forward +
           backward at V = 151,936, H 896 / 3584, N 4096 / 16384, bf16 hidden and weight (a production actor's
           dtypes), loss Σ g·logp (verl's default entropy_coeff = 0; entropy computed, as verl's actor asks):
           ``verl_torch`` (``FusedLinearForPPOFunction``, chunk 512, verl/utils/experimental/torch_functional.py),
           ``verl_triton`` (``linear_cross_entropy``, verl/utils/kernel/), ours with nothing cut (``full``), at the
           default min-p (``min_p``: the Triton folds) and at top_k 20 + top_p 0.8 (``top_k_top_p``: torch folds),
           and the unfused baseline (``unfused``: [N, V] logits, log_softmax). Time: CUDA events, median of the
           repeats after warm-ups; memory: ``max_memory_allocated`` over the inputs'.
``sync``   Host synchronisations per micro-batch in the hot paths, counted with torch's own sync debug mode
           (``torch.cuda.set_sync_debug_mode("warn")``: one warning per synchronising call): the pipeline's
           ``measure`` + ``loss_pass``, and the safe-vocabulary log-probs (logits and hidden paths, forward and
           backward), with 2 and with 4 micro-batches; per micro-batch = the difference / 2.
``fsdp2``  Whether verl's own fused heads run on an FSDP2-sharded model on a GPU (verl #5633 / the CPU error
           "aten.mm.default: got mixed torch.Tensor and DTensor"): a tiny Qwen2, tied and untied embeddings, wrapped
           with ``fully_shard`` by verl's rule (``_select_fsdp2_wrap_targets``: decoder layers, and embed_tokens /
           lm_head unless tied), its forward replaced as verl's ``forward_with_torch_backend`` does (the final hidden
           states, then the fused head on ``self.lm_head.weight``), world size 1 (NCCL).

verl is not installable on the device (no package index; ``import verl`` pulls ray, tensordict, hydra): its files
are loaded unmodified from a copy of its package folder (``--verl-source``) with the package ``__init__`` files
skipped (they import the trainer stack, which these kernels do not use).

    python benchmarks/gpu_keep_settings.py --verl-source DIR [--parts fused sync fsdp2] [--quick] [--out DIR]

Results: ``benchmarks/results/fused_safe_vocab_cuda.json``, ``host_sync_cuda.json``, ``verl_fused_fsdp2_cuda.json``
(and copies under ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback
import types
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB = 151_936
RESULTS = ROOT / "benchmarks" / "results"


def _write(name: str, data: dict, out: str | None) -> None:
    text = json.dumps(data, indent=1, default=str)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(text)
    if out:
        Path(out, f"{name}.json").write_text(text)


def load_verl(source: str):
    """verl's package from ``source`` (its folder) without running the package ``__init__`` files."""
    src = Path(source)
    for name, sub in (("verl", src), ("verl.utils", src / "utils"), ("verl.plugin", src / "plugin")):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [str(sub)]
            sys.modules[name] = mod
    from verl.utils.experimental import torch_functional
    from verl.utils.kernel import linear_cross_entropy
    return torch_functional, linear_cross_entropy


# ------------------------------------------------------------------------------------------------------ fused
def _arm(name: str, verl_tf, verl_lce):
    from tim_plugins.safe_vocab import DEFAULT_MIN_P, safe_linear_logprobs
    from tim_plugins.truncation import Truncation

    truncs = {"full": Truncation(), "min_p": Truncation(min_p=DEFAULT_MIN_P),
              "top_k_top_p": Truncation(top_k=20, top_p=0.8)}
    if name == "verl_torch":
        return lambda h, w, y: verl_tf.FusedLinearForPPOFunction.apply(h, w, y, 1.0, 512)
    if name == "verl_triton":
        return lambda h, w, y: verl_lce.linear_cross_entropy(h, w, y, 1.0, "none", None)
    if name == "unfused":
        def unfused(h, w, y):
            logits = (h @ w.t()).float()
            logp = logits.log_softmax(-1)
            ent = -(logp.exp() * logp).sum(-1)
            return logp.gather(-1, y[:, None]).squeeze(-1), ent
        return unfused
    trunc = truncs[name]

    def ours(h, w, y):
        out = safe_linear_logprobs(h, w, y, trunc, compute_entropy=True)
        return out.logprobs, out.entropy
    return ours


def fused(args, verl_tf, verl_lce) -> dict:
    arms = ("verl_triton", "verl_torch", "full", "min_p", "top_k_top_p", "unfused")
    shapes = [(4096, 896), (16384, 896), (4096, 3584), (16384, 3584)]
    if args.quick:
        shapes = [(1024, 896)]
    res = {"vocab": VOCAB, "dtype": "bfloat16", "loss": "sum(g * logp)", "repeats": args.repeats,
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for n, hd in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(n, hd, device="cuda", generator=gen, dtype=torch.bfloat16)
        weight = (torch.randn(VOCAB, hd, device="cuda", generator=gen) * hd ** -0.5).to(torch.bfloat16)
        labels = torch.randint(0, VOCAB, (n,), device="cuda", generator=gen)
        g = torch.randn(n, device="cuda", generator=gen)
        zero = torch.zeros(n, device="cuda")
        shape = {}
        ref = None
        for name in arms:
            fn = _arm(name, verl_tf, verl_lce)
            try:
                times, peak, vals = [], None, None
                for rep in range(args.warmup + args.repeats):
                    h = hidden.detach().clone().requires_grad_()
                    w = weight.detach().clone().requires_grad_()
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    logp, ent = fn(h, w, labels)
                    # verl's actor loss adds entropy_coeff (default 0) x its masked mean of the entropy: both outputs
                    # get a dense gradient (verl's Triton backward requires contiguous ones)
                    ((logp.float() * g).sum() + (ent.float() * zero).sum()).backward()
                    end.record()
                    torch.cuda.synchronize()
                    if rep >= args.warmup:
                        times.append(start.elapsed_time(end) / 1e3)
                        peak = torch.cuda.max_memory_allocated() - base
                    vals = (logp.detach().float(), ent.detach().float(), h.grad.float(), w.grad.float())
                    del h, w, logp, ent
                entry = {"seconds_median": statistics.median(times), "seconds": times,
                         "peak_mib": peak / 2**20}
                if name == "verl_triton":
                    ref = vals
                elif ref is not None and name in ("full", "verl_torch", "unfused"):
                    entry["vs_verl_triton"] = {
                        "logp_max_abs": float((vals[0] - ref[0]).abs().max()),
                        "entropy_max_abs": float((vals[1] - ref[1]).abs().max()),
                        "grad_hidden_rel": float((vals[2] - ref[2]).norm() / ref[2].norm()),
                        "grad_weight_rel": float((vals[3] - ref[3]).norm() / ref[3].norm())}
                shape[name] = entry
                print(f"N={n} H={hd} {name}: {entry['seconds_median'] * 1e3:.1f} ms, peak {entry['peak_mib']:.0f} MiB",
                      flush=True)
            except Exception as exc:  # an arm that fails is a finding, not the end of the run
                shape[name] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
                print(f"N={n} H={hd} {name}: {shape[name]['error']}", flush=True)
            torch.cuda.empty_cache()
        ratios = {}
        for base_arm in ("verl_triton", "verl_torch"):
            if "seconds_median" in shape.get(base_arm, {}):
                b = shape[base_arm]
                ratios[base_arm] = {a: {"time": shape[a]["seconds_median"] / b["seconds_median"],
                                        "memory": shape[a]["peak_mib"] / b["peak_mib"]}
                                    for a in ("full", "min_p", "top_k_top_p") if "seconds_median" in shape.get(a, {})}
        res["shapes"][f"N{n}_H{hd}"] = {"tokens": n, "hidden": hd, "arms": shape, "ratios": ratios}
        _write("fused_safe_vocab_cuda", res, args.out)
        del hidden, weight
        torch.cuda.empty_cache()
    return res


# ------------------------------------------------------------------------------------------------------- sync
class _SyncCounter:
    def __init__(self) -> None:
        self.n = 0
        self.where: dict[str, int] = {}

    def __enter__(self):
        self._cm = warnings.catch_warnings(record=True)
        self._rec = self._cm.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("default")
        self._cm.__exit__(*exc)
        for w in self._rec:
            if "synchroniz" in str(w.message):
                self.n += 1
                key = f"{Path(w.filename).name}:{w.lineno}"
                self.where[key] = self.where.get(key, 0) + 1
        return False


def _micro_batches(k: int, vocab: int = 4099, rows: int = 4, length: int = 64):
    gen = torch.Generator(device="cuda").manual_seed(k)
    out = []
    for _ in range(k):
        logits = torch.randn(rows * length, vocab, device="cuda", generator=gen) * 3
        tokens = torch.randint(0, vocab, (rows * length,), device="cuda", generator=gen)
        rollout = torch.randn(rows, length, device="cuda", generator=gen).mul(0.1).sub(2)
        mask = torch.rand(rows, length, device="cuda", generator=gen) > 0.1
        out.append((logits, tokens, rollout, mask))
    return out


def sync(args) -> dict:
    from tim_plugins.pipeline import StepPipeline, pipeline_config
    from tim_plugins.safe_vocab import safe_linear_logprobs, safe_logprobs_from_logits
    from tim_plugins.truncation import Truncation

    cases = {}

    def pipeline_case(k: int, trunc: Truncation, label: str):
        pipe = StepPipeline(pipeline_config(monitor=True, safe_vocab=True))
        batches = _micro_batches(k)
        torch.cuda.synchronize()
        with _SyncCounter() as c:
            for logits, tokens, rollout, mask in batches:
                lg = logits.clone().requires_grad_()
                res = safe_logprobs_from_logits(lg, tokens, min_p=trunc.min_p, top_p=trunc.top_p, top_k=trunc.top_k,
                                                compute_entropy=True, check_ids=False)
                shaped = type(res)(**{f: (None if getattr(res, f) is None else getattr(res, f).view(mask.shape))
                                      for f in ("logprobs", "in_safe", "pruned_mass", "size", "entropy")})
                train = shaped.logprobs.detach()
                weights = pipe.measure(rollout, train, mask, safe=shaped)
                pipe.loss_pass(rollout, train, shaped.logprobs.detach(), mask)
                factor = StepPipeline.loss_factor(mask, shaped.in_safe, weights)
                loss = (shaped.logprobs * factor).sum() - 0.01 * shaped.entropy.sum()
                loss.backward()
        return c

    def hidden_case(k: int, trunc: Truncation):
        gen = torch.Generator(device="cuda").manual_seed(7)
        w = (torch.randn(4099, 256, device="cuda", generator=gen) / 16).requires_grad_()
        hs = [torch.randn(256, 256, device="cuda", generator=gen).requires_grad_() for _ in range(k)]
        ys = [torch.randint(0, 4099, (256,), device="cuda", generator=gen) for _ in range(k)]
        torch.cuda.synchronize()
        with _SyncCounter() as c:
            for h, y in zip(hs, ys):
                out = safe_linear_logprobs(h, w, y, trunc, compute_entropy=True, check_ids=False)
                (out.logprobs.sum() + out.entropy.sum()).backward()
        return c

    for label, trunc in (("min_p", Truncation(min_p=1e-5)), ("top_k_top_p", Truncation(top_k=20, top_p=0.8)),
                         ("top_p", Truncation(top_p=0.9))):
        for kind, fn in (("pipeline_logits", pipeline_case), ("hidden_head", hidden_case)):
            call = (lambda k: fn(k, trunc)) if kind == "hidden_head" else (lambda k: fn(k, trunc, label))
            call(1)  # warm-up: one-time set-up (compiled kernels, cached bucket edges) is not per micro-batch
            counts = {k: call(k) for k in (2, 4)}
            per_mb = (counts[4].n - counts[2].n) / 2
            cases[f"{kind}/{label}"] = {"syncs_2_micro_batches": counts[2].n, "syncs_4_micro_batches": counts[4].n,
                                        "syncs_per_micro_batch": per_mb, "where_4": counts[4].where}
            print(f"sync {kind}/{label}: {counts[2].n} (2 mb), {counts[4].n} (4 mb): {per_mb} per micro-batch "
                  f"{counts[4].where}", flush=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": cases,
           "how": "torch.cuda.set_sync_debug_mode('warn'): one warning per synchronising call"}
    _write("host_sync_cuda", res, args.out)
    return res


# ------------------------------------------------------------------------------------------------------ fsdp2
def fsdp2(args, verl_tf, verl_lce) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tim_plugins.safe_vocab import safe_linear_logprobs
    from tim_plugins.truncation import Truncation

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": {}}
    heads = {  # verl's Triton head last: a failure there can leave the CUDA context unusable
        "verl_torch": lambda h, w, y: verl_tf.FusedLinearForPPO(impl_backend="torch")(
            hidden_states=h, vocab_weights=w, input_ids=y, temperature=1.0),
        # verl/models/transformers/dense_common.py forward_with_triton_backend: linear_cross_entropy
        "verl_triton": lambda h, w, y: verl_lce.linear_cross_entropy(h, w, y, 1.0, "none", None),
        "ours": lambda h, w, y: (lambda o: (o.logprobs, o.entropy))(
            safe_linear_logprobs(h, w.full_tensor() if hasattr(w, "full_tensor") else w, y,
                                 Truncation(min_p=1e-5), compute_entropy=True)),
    }
    order = [(tied, name) for name in ("verl_torch", "ours") for tied in (True, False)]
    order += [(True, "verl_triton"), (False, "verl_triton")]
    for tied, head_name in order:
        head = heads[head_name]
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
        model = Qwen2ForCausalLM(cfg).cuda()
        # verl/utils/fsdp_utils.py _select_fsdp2_wrap_targets: decoder layers, embed_tokens / lm_head unless tied
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if type(module).__name__ in model._no_split_modules or (not tied and leaf in ("embed_tokens",
                                                                                         "lm_head")):
                fully_shard(module)
        fully_shard(model)

        def forward(self, input_ids, labels):  # verl/models/transformers/dense_common.py forward_with_torch_backend
            hidden = self.model(input_ids=input_ids).last_hidden_state
            return head(hidden.squeeze(0), self.lm_head.weight, labels.squeeze(0))

        cls = type(model)
        saved = cls.forward
        cls.forward = forward
        key = f"{'tied' if tied else 'untied'}/{head_name}"
        try:
            ids = torch.randint(0, 1024, (1, 64), device="cuda")
            logp, ent = model(ids, torch.roll(ids, -1, 1))
            # dense gradients for both outputs, as verl's masked loss gives them (verl's Triton backward asserts it)
            (logp * torch.ones_like(logp) + ent * torch.zeros_like(ent)).sum().backward()
            res["cases"][key] = {"ok": True, "lm_head_weight_type": type(model.lm_head.weight).__name__,
                                 "logp_mean": float(logp.float().mean())}
        except Exception as exc:
            res["cases"][key] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500],
                                 "where": traceback.format_exc().strip().splitlines()[-3:]}
        finally:
            cls.forward = saved
        print(f"fsdp2 {key}: {res['cases'][key]}", flush=True)
        _write("verl_fused_fsdp2_cuda", res, args.out)  # after each case: a crashed context keeps what ran
        del model
    _write("verl_fused_fsdp2_cuda", res, args.out)
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verl-source", required=True, help="a copy of verl 0.9.1's package folder")
    ap.add_argument("--parts", nargs="+", default=["sync", "fsdp2", "fused"], choices=["fused", "sync", "fsdp2"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    verl_tf, verl_lce = load_verl(args.verl_source)
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    for part in args.parts:
        try:
            {"fused": lambda: fused(args, verl_tf, verl_lce), "sync": lambda: sync(args),
             "fsdp2": lambda: fsdp2(args, verl_tf, verl_lce)}[part]()
        except Exception:
            traceback.print_exc()


if __name__ == "__main__":
    main()
