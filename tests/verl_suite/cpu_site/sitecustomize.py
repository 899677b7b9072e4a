"""Test-only start-up hook (never shipped): every Python process of the verl end-to-end test (the main_ppo driver,
Ray's TaskRunner and workers, the vLLM server and its engine-core process) gets this folder on PYTHONPATH, so Python
imports this module at start-up. With ``TIM_TEST_CPU_SHIMS=1`` it installs the CPU shims of ``cpu_shims.py``, and
with ``TIM_TEST_RANK_VALUES_DIR`` set as well the per-rank recorder of ``rank_values.py``, with
``TIM_TEST_INJECT_MISMATCH`` the driver-side mismatch of ``inject_mismatch.py``, with ``TIM_TEST_TURN_PROBE`` the
driver-side recorder of ``turn_probe.py`` (installed after the mismatch: it chains onto the same module's hook), with
``TIM_TEST_SYNC_SKIP`` or ``TIM_TEST_LORA_KEEP`` the broken weight sync of ``skip_sync.py``; without them, it does
nothing."""

import os

if os.environ.get("TIM_TEST_CPU_SHIMS") == "1":
    import cpu_shims

    if os.environ.get("TIM_TEST_RANK_VALUES_DIR"):
        import rank_values

        rank_values.install()
    if os.environ.get("TIM_TEST_INJECT_MISMATCH"):
        import inject_mismatch

        inject_mismatch.install()
    if os.environ.get("TIM_TEST_TURN_PROBE"):
        import turn_probe

        turn_probe.install()
    if os.environ.get("TIM_TEST_SYNC_SKIP") or os.environ.get("TIM_TEST_LORA_KEEP"):
        import skip_sync

        skip_sync.install()
    cpu_shims.install()
