"""tim-plugins: make training-inference mismatch (TIM) in LLM RL visible and fixable.

The library (this package) depends on torch only and imports no framework; the framework adapters live in
``tim_plugins.integrations.trl``, ``.verl`` and ``.vllm``, and the applications (the ``tim-plugins`` command line)
in ``tim_plugins.apps``, the one part of the package that may import adapters and frameworks.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
