"""Test helper: let accelerate apply the FSDP plugin transformers hands it on a CPU launch (gloo), as it does on GPUs:
FSDP2, and FSDP1 (the module keeps the name of its first use).

accelerate (1.15, ``accelerate/state.py`` ``AcceleratorState.__init__``) turns a multi-process run into
``DistributedType.FSDP`` only inside its branch for ``MULTI_GPU`` / ``MULTI_XPU`` / ... (line 986; the switch at
line 1010: ``if (os.environ.get("ACCELERATE_USE_FSDP", ...) == "true" or fsdp_plugin is not None) ...``); a CPU launch
(``GRPOConfig(use_cpu=True)``, ``torch.distributed.run``) is ``MULTI_CPU``, outside that branch, so the plugin is
dropped without a word and the model is wrapped in DDP (``Accelerator.prepare_model``'s ``MULTI_CPU`` branch). torch's
``fully_shard`` and ``FullyShardedDataParallel`` themselves run on the CPU with gloo. ``cpu_fsdp2()`` does, on a CPU
launch, what that branch does on a GPU: the state's type becomes ``FSDP`` with the plugin (and ``PartialState``'s type
with it, as accelerate writes it at the end of the same ``__init__``); accelerate's own ``fsdp2_prepare_model`` (FSDP2)
or ``FullyShardedDataParallel(model, ..., device_id=self.device)`` in ``prepare_model`` (FSDP1) then shards the model.
FSDP1 only, one more assignment: accelerate names the CPU device ``cpu:0`` (``PartialState.set_device``, state.py line
844: ``torch.device("cpu", local_process_index % torch.cpu.device_count())``), which FSDP1 rejects as its
``device_id``: ``torch/distributed/fsdp/_init_utils.py`` ``_get_compute_device`` (line 1101) takes the compute device
of a CPU module as ``torch.device(torch.cpu.current_device())``, ``cpu``, and raises ``ValueError: Inconsistent
compute device and `device_id` on rank 0: cpu vs cpu:0``; the state's device becomes ``cpu``, the same device (on a
GPU both are ``cuda:<local rank>``). FSDP2 takes ``cpu:0`` as it is. Nothing else is replaced. On exit
``AcceleratorState.__init__`` is put back, and ``ACCELERATE_USE_FSDP``, which ``Accelerator`` sets in ``os.environ``
whenever it is given a plugin, is restored: left set, a later trainer in the same process would build an FSDP plugin
from it and take accelerate's FSDP gradient clipping on a DDP model (the state itself, device included, is rebuilt by
each ``TrainingArguments``).
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["cpu_fsdp2"]


@contextlib.contextmanager
def cpu_fsdp2():
    """Within the block, an ``AcceleratorState`` built with an ``fsdp_plugin`` on a ``MULTI_CPU`` launch is FSDP (with
    FSDP1, on the device ``cpu``)."""
    import accelerate.state as state
    import torch
    from accelerate.utils import DistributedType

    init = state.AcceleratorState.__init__
    env = os.environ.get("ACCELERATE_USE_FSDP")

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            if fsdp_plugin.fsdp_version == 1 and self.device == torch.device("cpu", 0):
                self.device = state.PartialState._shared_state["device"] = torch.device("cpu")

    state.AcceleratorState.__init__ = __init__
    try:
        yield
    finally:
        state.AcceleratorState.__init__ = init
        if env is None:
            os.environ.pop("ACCELERATE_USE_FSDP", None)
        else:
            os.environ["ACCELERATE_USE_FSDP"] = env
