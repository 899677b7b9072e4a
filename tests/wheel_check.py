"""Run by `make test-wheel` with the interpreter of a fresh virtualenv holding only the built wheel (+ torch,
the [hf,report] extras and trl): the adapters must be importable from the wheel, not from the source tree."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import tim_plugins

src = Path(tim_plugins.__file__).resolve()
if "site-packages" not in str(src):
    raise SystemExit(f"tim_plugins was imported from {src}, not from the installed wheel")

# The verl and vLLM adapters are imported without their frameworks here: only their presence in the wheel is checked.
for name in ("tim_plugins.integrations", "tim_plugins.integrations.trl", "tim_plugins.integrations.verl",
             "tim_plugins.integrations.vllm"):
    spec = importlib.util.find_spec(name)
    if spec is None or "site-packages" not in str(spec.origin):
        raise SystemExit(f"{name} is missing from the wheel (spec: {spec})")

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402,F401  (trl is installed)

eps = importlib.metadata.entry_points(group="verl.plugins")
if not any(ep.value == "tim_plugins.integrations.verl.plugin" for ep in eps):
    raise SystemExit(f"verl.plugins entry point missing: {list(eps)}")

out = subprocess.run([str(Path(sys.executable).with_name("tim-plugins")), "--help"], capture_output=True, text=True)
if out.returncode != 0 or "measure" not in out.stdout:
    raise SystemExit(f"tim-plugins --help failed: {out.stdout}\n{out.stderr}")

# Importing the core must not import any framework.
code = ("import sys, tim_plugins, tim_plugins.metrics, tim_plugins.safe_vocab, tim_plugins.lr_control, "
        "tim_plugins.corrections, tim_plugins.parity; "
        "bad = [m for m in ('trl', 'verl', 'vllm', 'ray', 'wandb', 'flash_attn') if m in sys.modules]; "
        "sys.exit(f'core imported {bad}' if bad else 0)")
subprocess.run([sys.executable, "-c", code], check=True)
print("wheel: 1 passed, 0 failed")
