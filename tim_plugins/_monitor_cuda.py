"""The monitor's CUDA path: whether it runs, one Triton kernel launch per ``update()``, and the fallback to
torch when the kernel fails (``MismatchMonitor`` inherits it). Launches from a plan, the path taken by inputs
like those of an earlier launch, start in ``MismatchMonitor.update`` itself (``launch_planned``): every call
frame there counts. Triton is imported only once a CUDA batch arrives."""

from __future__ import annotations

import torch

from tim_plugins._mismatch_pass import want_compile
from tim_plugins._optional import is_triton_available

__all__: list[str] = []  # a part of MismatchMonitor, not an API of its own


class _CudaPath:
    """``MismatchMonitor``'s CUDA path. It reads and writes the monitor's state buffer (``_state``, and
    ``_spare_state``: the last reset's buffer, which a launch overwrites instead of zeroing a new one), and
    owns ``_kernel_scratch`` (the launch's buffers and plans) and ``_planned``."""

    def _use_triton(self, rollout: torch.Tensor) -> bool:
        """CUDA fast path: the one-kernel Triton pass, unless compilation is off (compile=False, or "auto"
        with TIM_PLUGINS_COMPILE=0): then plain torch, e.g. to debug. The choice is made once per monitor and
        ``compile`` setting (an environment lookup and a module lookup cost more than the rest of a launch)."""
        if not rollout.is_cuda or self._triton_failed:
            return False
        choice = self._triton_choice
        if choice is None or choice[0] != self.compile:
            wanted = want_compile(self.compile, rollout.device) and is_triton_available()
            choice = self._triton_choice = (self.compile, wanted)
        return choice[1]

    def _update_triton(self, rollout, train, mask, is_weights) -> bool:
        """One kernel launch for checked inputs; False (after a warning) if the kernel fails, and the caller
        uses torch."""
        fresh = self._state is None
        if fresh:  # the kernel writes the whole state: reuse the last reset's buffer, no zeroing launch
            spare, self._spare_state = self._spare_state, None
            if rollout.shape[0] == 0:  # no launch: the empty state
                self._state = self._new_state(rollout.device, torch.float64)
                fresh = False
            elif spare is not None and spare.get_device() == rollout.get_device() and spare.dtype == torch.float64:
                self._state = spare
            else:
                self._state = torch.empty(self._layout.n_state, dtype=torch.float64, device=rollout.device)
        elif rollout.shape[0] == 0:
            return True  # nothing to add (any device metric vector still describes the state)
        elif self._state.get_device() != rollout.get_device():  # a state restored from a checkpoint: CPU
            self._ensure_state(rollout.device, torch.float64)
        try:
            o = self._layout
            log_lo, log_hi = self._log_band
            self._device_metrics = triton_update(
                self._state, o.n_sums, rollout, train, mask, is_weights, log_lo, log_hi, fresh, o.n_signed_bins,
                o.hist_offset, o.bucket_count_offset, self._kernel_scratch,
            )
        except Exception as err:  # never let a kernel problem break a training step
            self._kernel_failed(err)
            if fresh:  # the buffer was never written
                self._state = None
            return False
        self._planned = launch_planned
        return True

    def _kernel_failed(self, err: Exception) -> None:
        import warnings

        warnings.warn(f"tim_plugins: the Triton mismatch kernel failed ({err!r}); using torch.")
        self._triton_failed = True
        self._planned = None
        self._device_metrics = None


def triton_update(*args, **kwargs) -> torch.Tensor | None:
    global triton_update, launch_planned
    from tim_plugins._mismatch_launch import launch_planned as planned  # imports triton: CUDA path only
    from tim_plugins._mismatch_launch import triton_update as update

    # Later calls skip this wrapper and its import statements.
    triton_update, launch_planned = update, planned
    return update(*args, **kwargs)


launch_planned = None  # ``_mismatch_launch.launch_planned``, bound by the first triton_update call
