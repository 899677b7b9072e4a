"""TRL's vLLM client with a weight transfer that runs on the CPU (tests/test_trl_vllm_server.py's module docstring
says why): ``update_named_params`` writes what TRL streams to a safetensors file that the server reloads through its
own dev endpoint (``POST /collective_rpc reload_weights``). Shared by that test module and its two-process runner
(tests/trl_server_two_procs_run.py); never collected by pytest."""

from __future__ import annotations

from pathlib import Path

__all__ = ["patch_client", "reload_checkpoint"]


def patch_client(setattr_, weights_dir, synced: list, *, reload: bool = True, keep: str | None = None) -> None:
    """Replace the weight transfer of TRL's ``VLLMClient`` through ``setattr_`` (``MonkeyPatch.setattr``, or
    ``setattr`` in a process of its own). ``synced`` gets the number of tensors of each sync; ``reload=False``: the
    server never reloads (a stale server: TRL's sync runs, the weights never arrive); ``keep``: a name prefix whose
    tensors the server is sent as they were at the first sync (a layer the sync skips)."""
    from safetensors.torch import save_file
    from trl.generation.vllm_client import VLLMClient

    first = {}

    def init_communicator(self, device=0):
        if self.get_server_info()["weight_transfer_config"] != {"backend": "nccl"}:  # TRL's server flags
            raise AssertionError("the server was not started with TRL's weight-transfer engine")

    def update_named_params(self, metadata, named_params):
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in named_params}
        if [m[0] for m in metadata] != list(tensors):
            raise AssertionError("TRL streamed other tensors than it announced")
        synced.append(len(tensors))
        if not reload:
            return
        if keep is not None:
            tensors = {name: first.setdefault(name, t.clone()) if name.startswith(keep) else t
                       for name, t in tensors.items()}
        save_file(tensors, str(Path(weights_dir) / "model.safetensors"))
        r = self.session.post(f"{self.base_url}/collective_rpc", timeout=120,
                              json={"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}})
        r.raise_for_status()

    setattr_(VLLMClient, "init_communicator", init_communicator)
    setattr_(VLLMClient, "update_named_params", update_named_params)


def reload_checkpoint(base_url: str, model_path) -> None:
    """The server back at the checkpoint's weights (an earlier run left it at its own)."""
    import requests

    requests.post(f"{base_url}/collective_rpc", timeout=120,
                  json={"method": "reload_weights", "kwargs": {"weights_path": str(model_path)}}).raise_for_status()
