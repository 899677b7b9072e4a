"""The study's verifiable task and its tiny model: sort a few digits, exact-match reward.

Prompt ``"3141="``, answer ``"1134"`` then EOS. A character-level tokenizer (digits, ``=``, 26 filler letters,
pad, eos: an odd vocabulary of 39 so the sampler always has a tail of interchangeable wrong tokens) and a
Qwen2 of ~0.1M parameters. A short supervised warm start (teacher forcing on correct answers) brings the
policy to a non-trivial success rate so GRPO has a signal from step 1; the warm-started checkpoint is cached
(keyed by the recipe), so every arm and seed starts from the same weights.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["TaskSpec", "VOCAB", "make_prompts", "sort_reward", "build_tokenizer", "warm_start", "evaluate"]

PAD, EOS = "<pad>", "<eos>"
VOCAB = [PAD, EOS, "="] + [str(d) for d in range(10)] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
RECIPE_VERSION = "study-sort-v1"


@dataclass(frozen=True)
class TaskSpec:
    min_digits: int = 3
    max_digits: int = 6
    hidden_size: int = 64
    num_layers: int = 2
    sft_steps: int = 250
    sft_lr: float = 3e-3
    sft_batch: int = 64
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps({"v": RECIPE_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def make_prompts(n: int, spec: TaskSpec, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(spec.min_digits, spec.max_digits)
        out.append("".join(str(rng.randrange(10)) for _ in range(k)) + "=")
    return out


def answer_of(prompt: str) -> str:
    return "".join(sorted(prompt.rstrip("=")))


def sort_reward(prompts, completions, **kwargs) -> list[float]:
    """Exact match: 1.0 when the decoded completion (special tokens dropped) is the sorted digits, else 0."""
    return [float(c.strip() == answer_of(p)) for p, c in zip(prompts, completions)]


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
        max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    model = Qwen2ForCausalLM(cfg)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def _sft_batch(tokenizer, spec: TaskSpec, rng: random.Random, n: int):
    import torch

    texts = [p + answer_of(p) for p in make_prompts(n, spec, rng.randrange(1 << 30))]
    ids = [tokenizer.encode(t) + [tokenizer.eos_token_id] for t in texts]
    width = max(len(x) for x in ids)
    inp = torch.full((n, width), tokenizer.pad_token_id)
    labels = torch.full((n, width), -100)
    attn = torch.zeros((n, width), dtype=torch.long)
    for i, (t, x) in enumerate(zip(texts, ids)):
        inp[i, width - len(x):] = torch.tensor(x)  # left padding, as at rollout time
        attn[i, width - len(x):] = 1
        n_prompt = t.index("=") + 1
        labels[i, width - len(x) + n_prompt:] = torch.tensor(x[n_prompt:])  # loss on the answer + EOS only
    return inp, attn, labels


def evaluate(model, tokenizer, spec: TaskSpec, n: int = 128, seed: int = 12345, temperature: float = 1.0) -> float:
    """Exact-match rate of sampled completions (temperature 1: what GRPO sees at step 0)."""
    import torch

    prompts = make_prompts(n, spec, seed)
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=temperature > 0, temperature=temperature or None, top_k=0,
                             max_new_tokens=spec.max_digits + 4, pad_token_id=tokenizer.pad_token_id)
    comps = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(sort_reward(prompts, comps)) / n


def warm_start(spec: TaskSpec, cache_dir: Path, log=print) -> Path:
    """Build + supervised warm start, cached under ``cache_dir/<recipe key>`` (returns the model path)."""
    import torch

    path = Path(cache_dir) / f"warm-{spec.key()}"
    if (path / "done.json").exists():
        return path
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
    acc = evaluate(model, tokenizer, spec)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "done.json").write_text(json.dumps({"spec": asdict(spec), "sampled_exact_match": acc,
                                                "final_sft_loss": float(loss)}, indent=1))
    log(f"warm start: {spec.sft_steps} SFT steps, sampled exact match {acc:.3f} -> {path}")
    return path
