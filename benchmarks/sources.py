"""The private upstream code only the benchmarks rely on, each named with what is assumed of it.

The benchmarks time TRL from outside: they read TRL's own profiled blocks and run its log-prob kernel directly,
through names TRL does not export. A benchmark that silently measured something else after an upgrade would report
wrong ratios, so, like the adapters' registries (``hooks.TRL_SOURCES``, ``VERL_SOURCES``, ``VLLM_SOURCES``,
``TRANSFORMERS_SOURCES``), every use site names its entry here in a comment (``# BENCHMARK_SOURCES
<module>:<qualname>``; ``tests/test_upstream_sources.py`` checks that names and entries agree) and
``tests/test_benchmark_sources.py`` checks each assumption against the installed TRL. Private code a benchmark
shares with an adapter is named with the adapter's registry instead. This module imports nothing.
"""

from __future__ import annotations

__all__ = ["BENCHMARK_SINCE", "BENCHMARK_SOURCES"]

# (module, qualified name) -> what is assumed of it (TRL 1.16).
BENCHMARK_SOURCES = {
    ("trl.extras.profiling", "ProfilingContext._log_metrics"):
        "(self, duration) called once by __exit__ at the end of every profiled block, looked up on the class; "
        "self.name is the block's name ('GRPOTrainer._get_per_token_logps_and_entropies', "
        "'GRPOTrainer.transformers.generate', ...)",
    ("trl.kernels.chunked_logprob", "_use_triton"):
        "(device) -> bool: whether ChunkedLogProbFunction runs its Triton folds on that device",
    ("trl.trainer.utils", "_CHUNKED_LOGPROB_CHUNK_SIZE"):
        "the vocabulary tile (an int) add_fused_lm_head passes to the chunked log-prob kernel",
}

# Entries that exist from a TRL release on: (distribution, first release). Older releases lack the code the
# benchmark needs (its variant does not run there), so the guard test checks them only from then on.
BENCHMARK_SINCE = {
    ("trl.kernels.chunked_logprob", "_use_triton"): ("trl", "1.16"),
    ("trl.trainer.utils", "_CHUNKED_LOGPROB_CHUNK_SIZE"): ("trl", "1.15"),
}
