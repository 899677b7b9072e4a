"""The study's verifiable task and its tiny model: long letter chains with sustained entropy.

Prompt ``"dkqx="``: k distinct letters. A valid completion is a chain of letters from that set with no letter
twice in a row (``"dqkxqdkq..."``): every position has k − 1 equally correct choices, so the policy's entropy
stays near log(k − 1) however well it learns, and every wrong token (another letter, a repeat, a digit, a
special token) ends the chain. The reward is the length of the valid prefix over the target length L (the
completion budget), so a per-token error rate ε compounds over the sequence: E[reward] ≈ (1 − (1 − ε)^L) / (εL).

Two warm starts share the tokenizer and architecture (a Qwen2 of ~0.1M parameters):
- ``chain``: supervised on valid chains of ``sft_length`` tokens without EOS; rollouts run to the budget L.
- ``chain_stop``: supervised on short chains (``stop_lengths``) ended by EOS; the length-surge scenario then
  switches to a reward that favours length (`reward_for`), and the response length surges.
The warm start stops early on purpose (``sft_steps``) so the policy still errs and RL has something to learn.
Checkpoints are cached, keyed by the recipe, so every arm and seed starts from the same weights.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path

__all__ = ["TaskSpec", "VOCAB", "LETTERS", "make_prompts", "chain_stats", "reward_for", "build_tokenizer",
           "warm_start", "task_spec"]

PAD, EOS = "<pad>", "<eos>"
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
VOCAB = [PAD, EOS, "="] + [str(d) for d in range(10)] + LETTERS  # 39 tokens: an odd vocabulary
RECIPE_VERSION = "study-chain-v1"


@dataclass(frozen=True)
class TaskSpec:
    variant: str = "chain"  # chain | chain_stop
    set_size: int = 4
    sft_length: int = 192  # chain: tokens per supervised chain (>= the longest budget studied)
    stop_lengths: tuple = (6, 24)  # chain_stop: supervised chain lengths (uniform), then EOS
    hidden_size: int = 64
    num_layers: int = 2
    sft_steps: int = 500
    sft_lr: float = 3e-3
    sft_batch: int = 32
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps({"v": RECIPE_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def task_spec(variant: str, cfg=None) -> TaskSpec:
    """The study's two recipes; a StudyConfig may change the model size and the warm start's length (the same
    for every arm of a study: no per-arm option reaches them)."""
    if variant == "chain":
        spec = TaskSpec()
    elif variant == "chain_stop":
        spec = TaskSpec(variant="chain_stop", sft_steps=1500)
    else:
        raise ValueError(f"task variant {variant!r}: choose 'chain' or 'chain_stop'")
    if cfg is not None:
        changes = {k: getattr(cfg, k) for k in ("hidden_size", "num_layers") if getattr(cfg, k) is not None}
        if variant == "chain":  # supervised chains cover the longest budget studied
            changes["sft_length"] = max(spec.sft_length, int(cfg.budget), *(int(x) for x in cfg.lengths))
        if cfg.warm_start_steps is not None:
            changes["sft_steps"] = int(cfg.warm_start_steps) * (3 if variant == "chain_stop" else 1)
        spec = replace(spec, **changes)
    return spec


def make_prompts(n: int, spec: TaskSpec, seed: int, exclude: frozenset = frozenset()) -> list[str]:
    """n prompts of ``set_size`` distinct letters + '=', none of them in ``exclude`` (held-out prompts)."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        p = "".join(rng.sample(LETTERS, spec.set_size)) + "="
        if p not in exclude:
            out.append(p)
    return out


def chain_stats(prompt: str, tokens: list[str]) -> tuple[int, int, bool, int]:
    """(valid prefix length, valid tokens in all, ended by an error, length) of one completion given as
    token strings. The length counts the tokens before EOS (all of them without EOS); a token is valid when it
    is a prompt letter other than the token before it; the prefix stops at the first invalid token."""
    allowed = set(prompt.rstrip("="))
    length = tokens.index(EOS) if EOS in tokens else len(tokens)
    prefix, total, broken, prev = 0, 0, False, None
    for t in tokens[:length]:
        ok = t in allowed and t != prev
        total += ok
        broken = broken or not ok
        prefix += not broken
        prev = t
    return prefix, total, broken, length


def reward_for(variant: str, budget: int, surge_after: int | None = None):
    """TRL reward function (token ids → tokens, so special tokens count as errors).

    chain: valid prefix / budget. chain_stop: until step ``surge_after`` the length-neutral fraction of valid
    tokens (valid tokens / length: its expectation, 1 − the per-token error rate, does not depend on the
    length); from then on valid prefix / budget, which favours long valid chains.
    """
    def reward(prompts, completions, completion_ids=None, trainer_state=None, **kwargs) -> list[float]:
        step = int(getattr(trainer_state, "global_step", 0) or 0)
        neutral = variant == "chain_stop" and surge_after is not None and step < surge_after
        out = []
        for prompt, ids in zip(prompts, completion_ids):
            prefix, total, _err, length = chain_stats(prompt, [VOCAB[i] for i in ids])
            out.append(total / max(1, length) if neutral else prefix / budget)
        return out

    reward.__name__ = f"{variant}_reward"
    return reward


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS)
    fast.padding_side = "left"
    return fast


def _build_model(spec: TaskSpec, tokenizer):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(spec.seed)
    cfg = Qwen2Config(
        vocab_size=len(VOCAB), hidden_size=spec.hidden_size, intermediate_size=2 * spec.hidden_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    model = Qwen2ForCausalLM(cfg)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def _random_chain(rng: random.Random, letters: str, n: int) -> str:
    out, prev = [], None
    for _ in range(n):
        prev = rng.choice([c for c in letters if c != prev])
        out.append(prev)
    return "".join(out)


def _sft_batch(tokenizer, spec: TaskSpec, rng: random.Random, n: int):
    import torch

    prompts = make_prompts(n, spec, rng.randrange(1 << 30))
    ids = []
    for p in prompts:
        if spec.variant == "chain":
            ids.append(tokenizer.encode(p + _random_chain(rng, p[:-1], spec.sft_length)))
        else:
            k = rng.randint(*spec.stop_lengths)
            ids.append(tokenizer.encode(p + _random_chain(rng, p[:-1], k)) + [tokenizer.eos_token_id])
    width = max(len(x) for x in ids)
    inp = torch.full((n, width), tokenizer.pad_token_id)
    labels = torch.full((n, width), -100)
    attn = torch.zeros((n, width), dtype=torch.long)
    n_prompt = spec.set_size + 1
    for i, x in enumerate(ids):
        inp[i, width - len(x):] = torch.tensor(x)  # left padding, as at rollout time
        attn[i, width - len(x):] = 1
        labels[i, width - len(x) + n_prompt:] = torch.tensor(x[n_prompt:])  # loss on the completion only
    return inp, attn, labels


def warm_start(spec: TaskSpec, cache_dir: Path, log=print) -> Path:
    """Build + supervised warm start, cached under ``cache_dir/<recipe key>`` (returns the model path)."""
    import torch

    path = Path(cache_dir) / f"warm-{spec.key()}"
    if (path / "done.json").exists():
        return path
    torch.manual_seed(spec.seed)
    tokenizer = build_tokenizer()
    model = _build_model(spec, tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr)
    rng = random.Random(spec.seed)
    model.train()
    for _ in range(spec.sft_steps):
        inp, attn, labels = _sft_batch(tokenizer, spec, rng, spec.sft_batch)
        loss = model(input_ids=inp, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "done.json").write_text(json.dumps({"spec": asdict(spec), "final_sft_loss": float(loss)}, indent=1))
    log(f"warm start {spec.variant}: {spec.sft_steps} SFT steps, loss {float(loss):.3f} -> {path}")
    return path
