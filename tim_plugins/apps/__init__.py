"""The applications on top of the library: the ``tim-plugins`` command line (``apps.cli``) and its subcommands
(``demo``, ``measure``, ``report``, ``audit`` / ``check-batch-invariance``, ``lr-replay``).

The only part of ``tim_plugins`` that may import the adapters (``tim_plugins.integrations``) and the frameworks
(trl, verl, vllm); each subcommand imports them inside the command, when it runs.
"""
