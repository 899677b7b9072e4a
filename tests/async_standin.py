"""The stand-in engine and the CPU shims of the AsyncGRPOTrainer tests (tests/test_trl_async.py,
tests/trl_async_two_procs_run.py); see tests/test_trl_async.py for what runs and why. Never collected by pytest."""

from __future__ import annotations

import queue

import numpy as np
import torch
from transformers import AutoModelForCausalLM
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from tim_plugins.toy_model import synthetic_prompts

GROUP, NEW_TOKENS = 4, 6


def fetch_lag(k: int) -> int:
    """Versions back the k-th group handed to the trainer was sampled at. The trainer trains two micro-batches (one
    group each) a step, and accelerate's dispatcher fetches one ahead: from the second step on, the odd-numbered
    fetches train in the step that fetched them and the even-numbered ones one sync later. So odd fetches are fresh
    (lag 0 at the loss, every step) and even ones 0, 1, 2 versions old (lag 1, 2, 3 at the loss)."""
    return 0 if k % 2 else (k // 2) % 3


def cpu_tree_attention(module, query, key, value, attention_mask, *, tree_kv_index, tree_cu_seqlens_q,
                       tree_cu_seqlens_k, scaling=None, **kwargs):
    """TRL's tree attention (packing.tree_attention) without the FA3 kernel: each segment's queries attend causally
    (aligned at the end) to the keys of its root-to-segment path."""
    q, k, v = (x.transpose(1, 2)[0] for x in (query, key, value))  # [N, H, D]
    k, v = k.index_select(0, tree_kv_index), v.index_select(0, tree_kv_index)
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    out = torch.empty_like(q)
    cq, ck = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for s in range(len(cq) - 1):
        qs, ks, vs = q[cq[s]:cq[s + 1]], k[ck[s]:ck[s + 1]], v[ck[s]:ck[s + 1]]
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * (scaling or qs.shape[-1] ** -0.5)
        nq, nk = qs.shape[0], ks.shape[0]
        causal = torch.arange(nk).view(1, -1) <= torch.arange(nq).view(-1, 1) + (nk - nq)
        out[cq[s]:cq[s + 1]] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), vs)
    return out.unsqueeze(0), None


class StandInEngine:
    """Rollout worker + weight transfer in one: the toy model in bfloat16, loaded with the weights of the version it
    samples at (every synced version is kept), generating a group when the trainer finds the queue empty."""

    def __init__(self, model_path, tokenizer, trainer_state, lengths=lambda k: NEW_TOKENS):
        self.engine = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
        self.params = dict(self.engine.named_parameters())
        self.tok, self.prompts, self.state = tokenizer, synthetic_prompts(256, seed=3), trainer_state
        self.rollout_buffer, self.metrics_queue = _Buffer(self), queue.Queue()
        self.version, self.groups, self.received = 0, 0, {}
        self.weights: dict[int, dict] = {}  # version -> the weights synced as that version
        self.synced_at: dict[int, int] = {}  # version -> trainer global step when its weights were sent
        self.samples: list[dict] = []
        self.rng = np.random.default_rng(0)
        self.lengths = lengths  # group index -> completion tokens

    # WeightTransferProtocol
    def init_weight_transfer(self): pass
    def pause(self): pass
    def resume(self): pass
    def destroy(self): pass

    def send_weights(self, named):
        self.received = {name: tensor.detach().clone() for name, tensor in named}

    # RolloutWorkerProtocol
    def start(self): pass
    def stop(self): pass
    def check_health(self, stale_after_s): pass

    def update_model_version(self, version):
        self.version, self.weights[version] = version, self.received
        self.synced_at[version] = int(self.state().global_step)

    def generate_group(self):
        version = max(1, self.version - fetch_lag(self.groups))
        with torch.no_grad():
            for name, tensor in self.weights[version].items():
                self.params[name].copy_(tensor)
        prompt = self.tok(self.prompts[self.groups % len(self.prompts)], return_tensors="pt").input_ids
        with torch.no_grad():
            torch.manual_seed(self.groups)
            n = self.lengths(self.groups)
            seqs = self.engine.generate(prompt.repeat(GROUP, 1), do_sample=True, max_new_tokens=n, min_new_tokens=n,
                                        pad_token_id=self.tok.pad_token_id)
            logits = self.engine(seqs).logits.float()
        logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, seqs[:, 1:, None])[..., 0]
        for i in range(GROUP):
            mask = torch.zeros(seqs.shape[1], dtype=torch.long)
            mask[prompt.shape[1]:] = 1
            if self.groups % 3 == 2:  # a second turn: two tool-result tokens (not trained) after the first two
                mask[prompt.shape[1] + 2: prompt.shape[1] + 4] = 0
            old = torch.cat([torch.zeros(1), logps[i]])
            self.samples.append({"ids": seqs[i].clone(), "mask": mask.bool(), "engine": old.clone(),
                                 "version": version})
            self.rollout_buffer.put(RolloutSample(
                prompt=[], completion=[], input_ids=seqs[i].clone(), completion_mask=mask, old_log_probs=old,
                advantage=float(self.rng.choice([-1.0, 1.0])), model_version=version, group_id=self.groups,
                metrics={}))
        self.groups += 1


class _Buffer(queue.Queue):
    """The worker's queue: a sample group finishes when the trainer asks for one (never blocks)."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine

    def get(self, block=True, timeout=None):
        if self.empty():
            self.engine.generate_group()
        return super().get(block, timeout)


def _key(values) -> bytes:
    return np.asarray(values, dtype=np.float32).tobytes()




def reference_passes(model_path, engine: StandInEngine, passes) -> dict[int, list[tuple]]:
    """step -> [(lag, d, turn) per sample each loss pass trained], from the samples themselves: the lag from the step
    the engine saw its version synced at, d from a plain fp32 forward of the weights the trainer held at that pass
    (``passes``: (global_step, segment_id, old_log_probs, weights) of each loss call), turn from its tool gaps."""
    by_key = {}
    for s in engine.samples:
        by_key.setdefault(_key(s["engine"][s["mask"]]), s)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="eager").eval()
    out: dict[int, list] = {}
    for step, segment, old, weights in passes:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights[name])
        for seg in segment.unique().tolist():
            sample = by_key[_key(old[segment == seg].numpy())]
            with torch.no_grad():
                logits = model(sample["ids"][None]).logits[0].double()
            logp = torch.log_softmax(logits[:-1], -1).gather(-1, sample["ids"][1:, None])[:, 0]
            trained = sample["mask"]
            d = (logp[trained[1:]] - sample["engine"][trained].double()).numpy()
            # turn of each trained token: the untrained (tool) segments after the first trained token before it
            first = int(trained.nonzero()[0, 0])
            tool = ~trained[first:]
            starts = tool & ~torch.nn.functional.pad(tool[:-1], (1, 0), value=False)
            turn = starts.long().cumsum(0)[trained[first:]].numpy()
            out.setdefault(step + 1, []).append((step - engine.synced_at[sample["version"]], d, turn))
    return out


def make_trainer(model_path, out, steps, lengths=lambda k: NEW_TOKENS, learning_rate: float = 3e-3,
                 gradient_accumulation_steps: int = 2):
    """AsyncGRPOTrainer with the stand-in engine: two micro-batches (one group each) per step unless told, a sync
    every step. Returns (trainer, engine)."""
    import datasets
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    tok = AutoTokenizer.from_pretrained(model_path)
    holder = {}
    engine = StandInEngine(model_path, tok, lambda: holder["trainer"].state, lengths)
    args = AsyncGRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, per_device_train_batch_size=GROUP,
        gradient_accumulation_steps=gradient_accumulation_steps,
        num_generations=GROUP, max_completion_length=NEW_TOKENS, max_steps=steps, logging_steps=1, report_to=[],
        save_strategy="no", learning_rate=learning_rate, seed=0, disable_tqdm=True, token_budget=0, max_staleness=16,
        weight_sync_steps=1)
    trainer = holder["trainer"] = AsyncGRPOTrainer(
        model=str(model_path), reward_funcs=lambda **kw: [0.0], args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": synthetic_prompts(64)}), processing_class=tok,
        rollout_worker=engine, weight_transfer=engine)
    return trainer, engine


def install_cpu_shims():
    """What needs a GPU, for CPU runs, installed before the trainer is built: its tree attention registration also
    registers the plain one over it (the FA3 kernel comes from the Hub), and no MFU (no CUDA device name). Returns
    the undo."""
    from transformers.modeling_utils import AttentionInterface
    from trl.experimental.async_grpo import async_grpo_trainer as trl_async
    from trl.experimental.async_grpo.packing import TREE_ATTENTION

    peak, register = trl_async.get_peak_flops_per_device, trl_async.register_tree_attention

    def register_cpu():
        register()
        AttentionInterface.register(TREE_ATTENTION, cpu_tree_attention)

    trl_async.get_peak_flops_per_device = lambda accelerator, dtype: None
    trl_async.register_tree_attention = register_cpu

    def undo():
        trl_async.get_peak_flops_per_device, trl_async.register_tree_attention = peak, register

    return undo
