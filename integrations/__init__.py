"""Framework adapters, importable as ``tim_plugins.integrations.trl``, ``.verl`` and ``.vllm``.

They never import each other; each translates one framework's hooks into calls of the torch-only core.
"""
