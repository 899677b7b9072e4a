"""verl 0.9.x adapter (``tim_plugins.integrations.verl``).

Loaded in every verl process through the ``verl.plugins`` entry point (``.plugin``). Modules: ``config`` (the
``tim`` Hydra node), ``engine`` (FSDP actor engine hooks), ``optim`` (optimizers with the LR decay), ``worker`` and
``trainer`` (the ``tim_*`` V1 trainer modes), ``parity_spec`` (Hydra config → parity specs), ``sources`` (the verl
internals these rely on, ``VERL_SOURCES``). Importing this package imports nothing from verl.
"""

import sys


def _plugin_import_ended() -> None:
    """The last line of each module a script may import before verl (``plugin._IMPORTED_BEFORE_VERL``): verl's
    plugins, this package's among them, load at the first ``import verl``; where that was inside such a module's own
    import, the plugin deferred its registration to now (``plugin.register_deferred``). Nothing where verl has not
    loaded the plugin."""
    plugin = sys.modules.get(__name__ + ".plugin")
    if plugin is not None:
        plugin.register_deferred()
