"""Test-only start-up hook (never shipped): every Python process of the verl end-to-end test (the main_ppo driver,
Ray's TaskRunner and workers, the vLLM server and its engine-core process) gets this folder on PYTHONPATH, so Python
imports this module at start-up. With ``TIM_TEST_CPU_SHIMS=1`` it installs the CPU shims of ``cpu_shims.py``;
without it, it does nothing."""

import os

if os.environ.get("TIM_TEST_CPU_SHIMS") == "1":
    import cpu_shims

    cpu_shims.install()
