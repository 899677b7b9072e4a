"""verl tests run on CPU with the test-only CPU platform (tests/verl_suite/cpu_platform.py).

verl resolves its platform once (a cached singleton) and some engine modules read the device name at import
time, so the order matters: import verl with plugin auto-loading off, register the "cpu" platform, select it,
then load our plugin exactly as the ``verl.plugins`` entry point does. The Ray test checks the real entry-point
path in fresh worker processes."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ["VERL_ENGINE_DEVICE"] = "cuda"
os.environ.setdefault("VERL_ENGINE_VENDOR", "nvidia")
os.environ.pop("VERL_PLATFORM", None)
_policy = os.environ.get("VERL_USE_EXTERNAL_PLUGINS")
os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"
try:
    import cpu_platform  # noqa: E402,F401  (imports verl, registers the platform)
except ImportError:  # verl not installed: the test modules skip themselves
    cpu_platform = None
finally:
    if _policy is None:
        os.environ.pop("VERL_USE_EXTERNAL_PLUGINS", None)
    else:
        os.environ["VERL_USE_EXTERNAL_PLUGINS"] = _policy
if cpu_platform is not None:
    os.environ["VERL_PLATFORM"] = "cpu"
    import tim_plugins.integrations.verl.plugin  # noqa: E402,F401
