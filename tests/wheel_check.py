"""Run by `make test-wheel` with the interpreter of a fresh virtualenv holding only the built wheel with its
[hf,report,trl,verl] extras (+ torch): the adapters must be importable from the wheel, not from the source tree,
and `import verl` must register the tim engine and trainer modes (the [verl] extra brings what verl's default V1
trainer imports)."""

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

# The vLLM adapter is imported without vLLM here: only its presence in the wheel is checked.
for name in ("tim_plugins.integrations", "tim_plugins.integrations.hf", "tim_plugins.integrations.trl",
             "tim_plugins.integrations.verl", "tim_plugins.integrations.vllm"):
    spec = importlib.util.find_spec(name)
    if spec is None or "site-packages" not in str(spec.origin):
        raise SystemExit(f"{name} is missing from the wheel (spec: {spec})")

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402,F401  (trl is installed)

eps = importlib.metadata.entry_points(group="verl.plugins")
if not any(ep.value == "tim_plugins.integrations.verl.plugin" for ep in eps):
    raise SystemExit(f"verl.plugins entry point missing: {list(eps)}")

# The trainer adapters' fixes reach the report from the wheel's metadata (tim_plugins.fixes).
from tim_plugins.fixes import framework_fixes  # noqa: E402

if set(framework_fixes()) != {"trl", "verl"}:
    raise SystemExit(f"tim_plugins.fixes entry points missing from the wheel: {sorted(framework_fixes())}")

# A fresh process, as verl's driver and Ray workers are: the entry point alone loads the plugin on `import verl`.
code = ("import sys, verl; from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY; "
        "from verl.workers.engine import EngineRegistry; "
        "eng = EngineRegistry._engines['language_model']['fsdp2'][('cuda', 'nvidia')]; "
        "modes = sorted(k for k in TRAINER_REGISTRY if k.startswith('tim_')); print(eng.__module__, modes); "
        "sys.exit(0 if eng.__module__ == 'tim_plugins.integrations.verl.engine' and 'tim_sync' in modes else 1)")
out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
if out.returncode != 0 or "tim-plugins:" in out.stderr:
    raise SystemExit(f"import verl did not register the tim engine and trainer modes:\n{out.stdout}\n{out.stderr}")

out = subprocess.run([str(Path(sys.executable).with_name("tim-plugins")), "--help"], capture_output=True, text=True)
if out.returncode != 0 or "measure" not in out.stdout:
    raise SystemExit(f"tim-plugins --help failed: {out.stdout}\n{out.stderr}")

# Importing the core must not import any framework.
code = ("import sys, tim_plugins, tim_plugins.metrics, tim_plugins.safe_vocab, tim_plugins.lr_control, "
        "tim_plugins.corrections, tim_plugins.parity; "
        "bad = [m for m in ('trl', 'verl', 'vllm', 'ray', 'wandb', 'flash_attn', 'transformers') if m in sys.modules]; "
        "sys.exit(f'core imported {bad}' if bad else 0)")
subprocess.run([sys.executable, "-c", code], check=True)
print("wheel: 1 passed, 0 failed")
