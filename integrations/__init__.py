"""Framework adapters, importable as ``tim_plugins.integrations.hf``, ``.trl``, ``.verl`` and ``.vllm``.

Each translates one framework's hooks into calls of the torch-only core, which imports none of them and names none of
the frameworks' internals (``tests/test_layering.py``). The engine adapters (``hf``: transformers models and
``generate``; ``vllm``: the vLLM engine) import no other adapter; the trainer adapters (``trl``, ``verl``) may import
the engine adapters, whose engines they drive, and never each other.
"""
