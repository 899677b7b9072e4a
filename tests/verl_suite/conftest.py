"""verl tests run on CPU with the test-only CPU platform and shims of ``cpu_site/`` (see ``cpu_shims.py``).

verl resolves its platform once (a cached singleton) and some engine modules read the device name at import
time, so the shims go in before anything imports verl: the "cpu" platform is then registered the moment
``verl.plugin.platform`` is imported, and ``VERL_PLATFORM=cpu`` selects it. Our plugin loads through its
``verl.plugins`` entry point on ``import verl``, as in a user's process. The end-to-end test
(``test_verl_main_ppo.py``) gives every process of its runs the same shims through ``cpu_site/sitecustomize.py``.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "cpu_site"))
if "verl" in sys.modules:
    raise RuntimeError("tests/verl_suite: verl was imported before the CPU shims were installed; run the verl "
                       "suite in its own pytest process (make test does)")
os.environ["VERL_PLATFORM"] = "cpu"
os.environ["VERL_ENGINE_DEVICE"] = "cuda"  # verl's engine registry has no "cpu" key
os.environ.setdefault("VERL_ENGINE_VENDOR", "nvidia")

import cpu_shims  # noqa: E402

cpu_shims.install(vllm_plain_linear=False)
