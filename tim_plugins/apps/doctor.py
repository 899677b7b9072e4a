"""``tim-plugins doctor``: what this environment can run, in a few lines to paste into a bug report.

It prints the installed versions of the packages tim-plugins works with (and whether each lies in the tested
range), the device, and every feature of every adapter as available or off with the reason (a missing package,
an upstream hook that moved) and the fix. The features are the adapters' own tables (``integrations/*/features.py``),
the same checks the adapters run when they attach. Exit status 0 when the monitor can attach here (through TRL or
verl), 1 otherwise.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys
import warnings

__all__ = ["PACKAGES", "collect", "register", "render"]

# (distribution, import name) in the order printed.
PACKAGES = (("torch", "torch"), ("transformers", "transformers"), ("trl", "trl"), ("verl", "verl"),
            ("vllm", "vllm"), ("ray", "ray"), ("wandb", "wandb"), ("flash-attn", "flash_attn"),
            ("triton", "triton"), ("duckdb", "duckdb"))  # duckdb: the report's query engine (extra "report")

# adapter -> (module with its feature table, function returning the statuses, the import names it needs first: a
# missing one is the adapter's one [off] row, its fix that module's install command)
_ADAPTERS = (
    ("TRL", "tim_plugins.integrations.trl.features", "trl_features", ("trl", "transformers")),
    ("verl", "tim_plugins.integrations.verl.features", "verl_features", ()),
    # verl's Megatron backend: off, with the import error, where megatron-core is not installed
    ("verl Megatron", "tim_plugins.integrations.verl.features", "megatron_features", ("verl",)),
    ("vLLM", "tim_plugins.integrations.vllm.features", "vllm_features", ()),
    # verl's vLLM rollout server: the kept sets and the sync reads (imports verl's vLLM server, so only where both are)
    ("verl rollout", "tim_plugins.integrations.verl.features", "rollout_features", ("verl", "vllm")),
)
# The features whose availability means "the monitor can attach here".
MONITOR_FEATURES = ("monitor", "verl_engine")


def _versions() -> list[tuple[str, str | None, bool | None]]:
    from tim_plugins._optional import SUPPORTED_RANGES, is_supported_version, package_version

    rows = []
    for dist, _module in PACKAGES:
        version = package_version(dist)
        tested = is_supported_version(dist, version) if dist in SUPPORTED_RANGES and version else None
        rows.append((dist, version, tested))
    return rows


def _device() -> str:
    import torch

    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        return f"cuda: {torch.cuda.device_count()} x {', '.join(names)} (CUDA {torch.version.cuda})"
    return f"cpu ({os.cpu_count()} cores); no CUDA device"


def collect() -> dict:
    """{'versions': [(dist, version, tested)], 'device': str, 'features': [(adapter, [Status])], 'kept_set':
    [(framework, KeptSet)]} (never raises)."""
    from tim_plugins._optional import install_command, is_available
    from tim_plugins.capabilities import Feature, Status

    features = []
    for adapter, module, func, needs in _ADAPTERS:
        missing = [m for m in needs if not is_available(m)]
        if missing:
            stub = Feature(adapter.lower(), f"{adapter} adapter", missing[0])
            features.append((adapter, [Status(stub, False, f"{missing[0]} is not installed",
                                              install_command(missing[0]))]))
            continue
        try:
            # the frameworks' own import-time chatter (optional engines, platform probes) is not the report
            with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
                warnings.simplefilter("ignore")
                statuses = getattr(importlib.import_module(module), func)()
        except Exception as err:  # the doctor reports; it never fails on what it inspects
            stub = Feature(adapter.lower(), f"{adapter} adapter", adapter.lower())
            statuses = [Status(stub, False, f"cannot load {module} ({type(err).__name__}: {err})",
                               "report it with this output")]
        features.append((adapter, statuses))
    versions = _versions()
    return {"versions": versions, "device": _device(), "features": features, "kept_set": _kept_sets(versions)}


def _kept_sets(versions) -> list[tuple[str, object]]:
    """(framework, ``kept_set.KeptSet``) of each installed trainer framework: how its safe vocabulary gets the
    sampler's kept set (replayed from the engine, or recomputed on the trainer's logits) and why."""
    from tim_plugins.kept_set import FRAMEWORK_NAMES, kept_set

    installed = {dist: version for dist, version, _ in versions}
    return [(FRAMEWORK_NAMES[f], kept_set(f, installed[f])) for f in ("trl", "verl") if installed.get(f)]


def render(info: dict) -> tuple[str, bool]:
    """The printed report and whether the monitor can attach."""
    import platform

    lines = [f"tim-plugins doctor (python {platform.python_version()}, {platform.platform(terse=True)})"]
    versions = []
    for dist, version, tested in info["versions"]:
        note = "" if tested in (None, True) else " (untested)"
        versions.append(f"{dist} {version}{note}" if version else f"{dist} -")
    lines.append("packages: " + ", ".join(versions))
    lines.append(f"device:   {info['device']}")
    can_attach = False
    for adapter, statuses in info["features"]:
        lines.append(f"{adapter}:")
        for status in statuses:
            lines.append(status.line())
            can_attach |= status.available and status.name in MONITOR_FEATURES
    if info.get("kept_set"):
        lines.append("kept set (safe vocabulary):")
        lines += [f"  {name}: {k.mode}: {k.reason}" for name, k in info["kept_set"]]
    lines.append("monitor: can attach here" if can_attach else
                 "monitor: cannot attach here (see the [off] lines above for the fix)")
    return "\n".join(lines), can_attach


def _main(args) -> int:
    text, can_attach = render(collect())
    print(text)
    return 0 if can_attach else 1


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor", help="Print the installed versions, the device and every feature as available or off (with the "
                       "reason and the fix): paste it into a bug report. Exit 0 when the monitor can attach here.")
    p.set_defaults(func=_main)


if __name__ == "__main__":
    sys.exit(_main(None))
