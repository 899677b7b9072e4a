"""verl 0.9.x adapter (``tim_plugins.integrations.verl``).

Loaded in every verl process through the ``verl.plugins`` entry point (``.plugin``). Modules: ``config`` (the
``tim`` Hydra node), ``engine`` (FSDP actor engine hooks), ``optim`` (optimizers with the LR decay), ``worker`` and
``trainer`` (the ``tim_*`` V1 trainer modes), ``parity_spec`` (Hydra config → parity specs), ``sources`` (the verl
internals these rely on, ``VERL_SOURCES``). Importing this package imports nothing from verl.
"""
