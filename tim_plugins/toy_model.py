"""A small causal LM built locally (no model hub): byte-level BPE tokenizer + Qwen2 architecture.

Used as the default model of ``tim-plugins measure`` and by the test suites. The model is trained for a few
hundred steps on a synthetic corpus so that its next-token distributions are peaked with a long tail (a random
init is nearly uniform, which hides the (1 - p) structure of the mismatch). Built once and cached.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from tim_plugins._optional import require

__all__ = [
    "TOY_MODEL_VERSION",
    "default_cache_dir",
    "toy_model_cached",
    "synthetic_corpus",
    "synthetic_prompts",
    "PROMPT_KINDS",
    "build_toy_model",
]

# Bump when the recipe below changes, so stale caches are rebuilt.
TOY_MODEL_VERSION = "toy-qwen2-v1"

_WORDS = (
    "the a one two three four five six seven eight nine ten red blue green small large quick slow "
    "cat dog bird fish tree river stone cloud model token reward policy sample answer question sum "
    "plus minus equals is not and or because then so when where why how what who"
).split()


def default_cache_dir() -> Path:
    root = os.environ.get("TIM_PLUGINS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tim_plugins"
    )
    return Path(root)


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randrange(50), rng.randrange(50)
        return f"Q: {a} + {b} = ? A: {a + b}."
    if kind == 1:
        digits = [rng.randrange(10) for _ in range(rng.randrange(3, 7))]
        return f"sort {' '.join(map(str, digits))} -> {' '.join(map(str, sorted(digits)))}."
    n = rng.randrange(4, 12)
    return " ".join(rng.choice(_WORDS) for _ in range(n)).capitalize() + "."


def synthetic_corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [_sentence(rng) for _ in range(n)]


PROMPT_KINDS = ("sum", "sort", "text")


def synthetic_prompts(n: int, seed: int = 0, kinds: tuple[str, ...] = PROMPT_KINDS) -> list[str]:
    """Prompts whose continuation has both near-certain and open tokens, cycling through ``kinds``: "sum" (a sum to
    answer: a few near-certain tokens), "sort" (digits to sort) and "text" (three words to continue with free text
    of varied length, the open kind)."""
    bad = [k for k in kinds if k not in PROMPT_KINDS]
    if not kinds or bad:
        raise ValueError(f"synthetic_prompts(kinds={kinds!r}) is invalid: use some of {PROMPT_KINDS}.")
    rng = random.Random(10_000 + seed)
    prompts = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        if kind == "sum":
            prompts.append(f"Q: {rng.randrange(50)} + {rng.randrange(50)} = ? A:")
        elif kind == "sort":
            prompts.append("sort " + " ".join(str(rng.randrange(10)) for _ in range(rng.randrange(3, 7))) + " ->")
        else:
            prompts.append(" ".join(rng.choice(_WORDS) for _ in range(3)).capitalize())
    return prompts


def _toy_settings(path, *, vocab_size: int, hidden_size: int, num_layers: int, train_steps: int,
                  seed: int) -> tuple[dict, Path]:
    settings = dict(
        version=TOY_MODEL_VERSION, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
        train_steps=train_steps, seed=seed,
    )
    if path is None:
        tag = f"{TOY_MODEL_VERSION}-v{vocab_size}-h{hidden_size}-l{num_layers}-s{train_steps}-seed{seed}"
        path = default_cache_dir() / "models" / tag
    return settings, Path(path)


def _is_built(path: Path, settings: dict) -> bool:
    try:
        return json.loads((path / "tim_toy_model.json").read_text()) == settings
    except (OSError, ValueError):
        return False


def toy_model_cached() -> tuple[Path, bool]:
    """(the default toy model's folder, whether it is built and current there): what `build_toy_model()` would
    return, and whether it would build first. Imports nothing heavy (a command says so before it starts)."""
    import inspect

    recipe = {name: p.default for name, p in inspect.signature(build_toy_model).parameters.items()
              if p.kind is p.KEYWORD_ONLY and name != "force"}
    settings, path = _toy_settings(None, **recipe)
    return path, _is_built(path, settings)


def build_toy_model(
    path: str | os.PathLike | None = None,
    *,
    vocab_size: int = 383,
    hidden_size: int = 64,
    num_layers: int = 2,
    train_steps: int = 300,
    seed: int = 0,
    force: bool = False,
) -> Path:
    """Build (or reuse) the toy model and return its directory (loadable with ``from_pretrained``).

    ``vocab_size`` is odd on purpose: vocab-dependent code paths must not assume a power of two. head_dim is
    32 because vLLM's CPU attention needs head_dim >= 32.
    """
    require("transformers", "build_toy_model")
    require("tokenizers", "build_toy_model")
    settings, path = _toy_settings(path, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                                   train_steps=train_steps, seed=seed)
    if not force and _is_built(path, settings):
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    corpus = synthetic_corpus(4000, seed)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|pad|>")
    hf_tok.padding_side = "left"

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(hf_tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=hidden_size // 32, num_key_value_heads=1,
        head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id, bos_token_id=hf_tok.eos_token_id,
    )
    model = Qwen2ForCausalLM(config).float()
    _pretrain(model, hf_tok, corpus, train_steps, seed)
    model.generation_config.eos_token_id = hf_tok.eos_token_id
    model.generation_config.pad_token_id = hf_tok.pad_token_id

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    hf_tok.save_pretrained(tmp)
    (tmp / "tim_toy_model.json").write_text(json.dumps(settings))
    if path.exists():
        import shutil

        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, path)
    return path


def _pretrain(model, tokenizer, corpus: list[str], steps: int, seed: int) -> None:
    if steps <= 0:
        return
    import torch

    rng = random.Random(seed)
    eos = tokenizer.eos_token
    side, tokenizer.padding_side = tokenizer.padding_side, "right"  # positions start at 0 for every row
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = [rng.choice(corpus) + eos for _ in range(16)]
        enc = tokenizer(batch, return_tensors="pt", padding=True)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        loss = model(**enc, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    tokenizer.padding_side = side
    model.eval()
