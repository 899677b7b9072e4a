"""Test helper: let accelerate apply the FSDP2 plugin transformers hands it on a CPU launch (gloo), as it does on GPUs.

accelerate (1.15, ``accelerate/state.py`` ``AcceleratorState.__init__``) turns a multi-process run into
``DistributedType.FSDP`` only inside its branch for ``MULTI_GPU`` / ``MULTI_XPU`` / ... (line 986; the switch at
line 1010: ``if (os.environ.get("ACCELERATE_USE_FSDP", ...) == "true" or fsdp_plugin is not None) ...``); a CPU launch
(``GRPOConfig(use_cpu=True)``, ``torch.distributed.run``) is ``MULTI_CPU``, outside that branch, so the plugin is
dropped without a word and the model is wrapped in DDP (``Accelerator.prepare_model``'s ``MULTI_CPU`` branch). torch's
``fully_shard`` itself runs on the CPU with gloo. ``cpu_fsdp2()`` does, on a CPU launch, what that branch does on a
GPU: the state's type becomes ``FSDP`` with the plugin (and ``PartialState``'s type with it, as accelerate writes it
at the end of the same ``__init__``); accelerate's own ``fsdp2_prepare_model`` then shards the model. Nothing else
is replaced. On exit ``AcceleratorState.__init__`` is put back, and ``ACCELERATE_USE_FSDP``, which ``Accelerator``
sets in ``os.environ`` whenever it is given a plugin, is restored: left set, a later trainer in the same process
would build an FSDP plugin from it and take accelerate's FSDP gradient clipping on a DDP model.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["cpu_fsdp2"]


@contextlib.contextmanager
def cpu_fsdp2():
    """Within the block, an ``AcceleratorState`` built with an ``fsdp_plugin`` on a ``MULTI_CPU`` launch is FSDP."""
    import accelerate.state as state
    from accelerate.utils import DistributedType

    init = state.AcceleratorState.__init__
    env = os.environ.get("ACCELERATE_USE_FSDP")

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    state.AcceleratorState.__init__ = __init__
    try:
        yield
    finally:
        state.AcceleratorState.__init__ = init
        if env is None:
            os.environ.pop("ACCELERATE_USE_FSDP", None)
        else:
            os.environ["ACCELERATE_USE_FSDP"] = env
