"""tim-plugins: make training-inference mismatch (TIM) in LLM RL visible and fixable.

The core (this package) depends on torch only; framework adapters live in
``tim_plugins.integrations.trl`` and ``tim_plugins.integrations.verl``.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
