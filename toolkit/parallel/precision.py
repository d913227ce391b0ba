"""The training precision's element: its torch dtype and its bytes. One map from the spec's
``precision`` to torch's dtype name, read by the planner, the emitters (megatron's params_dtype),
the converters (dtype aliases), the HF integration and the runtime; stdlib only, so that reading
it imports no torch."""
from __future__ import annotations

PRECISION_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # spec.precision -> torch.<name>


def element_bytes(precision: str) -> int:
    """Bytes of one element of activations, 16-bit (or fp32) weights and gathered parameters."""
    return 4 if precision == "fp32" else 2
