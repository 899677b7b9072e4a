"""The applications on top of the library: the ``tim-plugins`` command line (``apps.cli``) and its subcommands
(``demo``, ``measure``, ``report``, ``audit`` / ``check-batch-invariance``, ``lr-replay``).

The only part of ``tim_plugins`` that may import the adapters (``tim_plugins.integrations``) and the frameworks
(transformers, trl, verl, vllm, ray); each subcommand imports them inside the command, when it runs, so no module
here imports a framework at import time (``tests/test_layering.py``).
"""
