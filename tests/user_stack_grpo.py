"""A user's first GRPOTrainer run with the monitor, in the user-stack environments of `make test-wheel`
(scripts/user_stack_check): run with the interpreter of a fresh virtualenv holding the user's TRL and transformers
and tim-plugins (the built wheel, or installed from a clone), from outside the source tree, with no
TIM_PLUGINS_SKIP_VERSION_CHECK in the environment.

It runs the README's TRL example as the install ships it (tim_plugins/integrations/trl/examples/quickstart.py:
``TIMCallback(trainer, TIMConfig())`` on a GRPOTrainer with the package's toy model, built locally since CI cannot
reach the model hub), in a temporary working directory, then asserts that tim/* keys appear in the trainer's
``state.log_history``. Prints one line `LABEL: 1 passed, 0 failed` (or `0 passed, 1 failed (reason)`) for
scripts/suite to count. Not collected by pytest (no test_ prefix).
"""

from __future__ import annotations

import os
import runpy
import sys
import tempfile
from pathlib import Path

label = sys.argv[1] if len(sys.argv) > 1 else "user-stack grpo"


def main() -> None:
    if os.environ.get("TIM_PLUGINS_SKIP_VERSION_CHECK") and not os.environ.get("TIM_USER_STACK_ALLOW_SKIP"):
        raise SystemExit("TIM_PLUGINS_SKIP_VERSION_CHECK is set: this check must run without any override")

    import tim_plugins.integrations

    installed = Path(tim_plugins.integrations.__file__).resolve().parent
    if "site-packages" not in str(installed):
        raise SystemExit(f"tim_plugins was imported from {installed}, not from the install in site-packages")
    example = installed / "trl" / "examples" / "quickstart.py"
    if not example.is_file():
        raise SystemExit(f"the install has no README TRL example at {example}")

    with tempfile.TemporaryDirectory(prefix="tim-user-stack-") as out:
        os.chdir(out)  # the example writes its output_dir relative to the working directory
        trainer = runpy.run_path(str(example), run_name="__main__")["trainer"]
    logged = sorted({k for h in trainer.state.log_history for k in h if k.startswith("tim/")})
    if not logged:
        raise SystemExit(f"no tim/* key in trainer.state.log_history: {trainer.state.log_history}")
    print(f"{label}: {len(logged)} tim/* keys logged by the README example, e.g. {logged[:3]}")


if __name__ == "__main__":
    try:
        main()
    except BaseException as err:  # one countable line whatever happened; the traceback above it
        import traceback

        traceback.print_exc()
        print(f"{label}: 0 passed, 1 failed ({type(err).__name__}: {str(err)[:300]})", flush=True)
        sys.exit(1)
    print(f"{label}: 1 passed, 0 failed", flush=True)
