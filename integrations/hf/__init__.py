"""HF adapter: tim-plugins' code that patches or reads transformers' internals (``.sources.TRANSFORMERS_SOURCES``).

- ``.recorder``: ``record_processed_logprobs(model)``, the processed log-probs of what ``model.generate`` samples
  (the core's `ProcessedLogprobRecorder` appended last to the processors ``generate`` builds);
- ``.rollout``: ``generate_with_logprobs``, HF ``generate`` rollouts as the core's ``RolloutBatch``;
- ``.parity_spec``: ``spec_from_hf_model``, a live transformers model's `PipelineSpec`.

An engine adapter, like ``.vllm``: the trainer adapters (TRL, verl) may import it, it imports no other adapter
(``tests/test_layering.py``). No module here imports transformers at import time (each reads the model it is handed,
or imports transformers inside the function that needs it), so importing this package needs torch only.
"""

from .parity_spec import spec_from_hf_model
from .recorder import RECORDABLE_MODES, ProcessedLogprobRecorder, record_processed_logprobs
from .rollout import generate_with_logprobs

__all__ = ["RECORDABLE_MODES", "ProcessedLogprobRecorder", "generate_with_logprobs", "record_processed_logprobs",
           "spec_from_hf_model"]
