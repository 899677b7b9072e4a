"""Framework adapters, importable as ``tim_plugins.integrations.trl`` and ``tim_plugins.integrations.verl``.

They never import each other; each translates one framework's hooks into calls of the torch-only core.
"""
