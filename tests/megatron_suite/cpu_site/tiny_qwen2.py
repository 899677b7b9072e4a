"""Test helper: a tiny Qwen2 checkpoint (random weights, word-level tokenizer) for verl's Megatron engine on CPU.

Sized for tensor parallelism 2: 4 attention heads and 2 key/value heads (Megatron splits both over the TP ranks),
hidden 64, 2 layers. The vocabulary is 128: mbridge 0.15.1 loads the output layer row-split over TP without padding
it (``padded_vocab_size`` is the HF ``vocab_size``), so an odd vocabulary would not split over two ranks.
``initializer_range`` is larger than Qwen2's default so that next-token distributions are far from uniform (a
random model with the default 0.02 is near-uniform on every position, which would make every safe set the whole
vocabulary). Built in a few seconds; written once per directory (``tiny_qwen2.json`` records the settings).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["VOCAB", "build_tiny_qwen2"]

VOCAB = 128
SETTINGS = {"version": 1, "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.1, "seed": 0}


def build_tiny_qwen2(path: str | os.PathLike, *, layers: int = SETTINGS["num_hidden_layers"]) -> Path:
    """Write the tiny Qwen2 (fp32 safetensors + tokenizer) to ``path`` unless it already holds this build;
    ``layers``: its decoder layers (4 for two pipeline stages of two virtual stages each)."""
    path = Path(path)
    marker = path / "tiny_qwen2.json"
    settings = {**SETTINGS, "num_hidden_layers": layers}
    if marker.exists() and json.loads(marker.read_text()) == settings:
        return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=SETTINGS["hidden_size"], intermediate_size=SETTINGS["intermediate_size"],
        num_hidden_layers=layers, num_attention_heads=SETTINGS["num_attention_heads"],
        num_key_value_heads=SETTINGS["num_key_value_heads"], max_position_embeddings=128, tie_word_embeddings=False,
        initializer_range=SETTINGS["initializer_range"], pad_token_id=0, eos_token_id=1, bos_token_id=1,
        torch_dtype="float32")
    torch.manual_seed(SETTINGS["seed"])
    model = Qwen2ForCausalLM(config).float()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    hf_tok.save_pretrained(path)
    marker.write_text(json.dumps(settings))
    return path
