"""What megatron-core 0.16.1 cannot run with gated delta net layers (linear attention,
``experimental_attention_variant="gated_delta_net"``: Qwen3-Next), as rules; the reasons are
its own asserts and NotImplementedErrors (transformer_config.py, ssm/gated_delta_net.py). The
recipes' runtime trains them otherwise (toolkit.mcore.gated_delta_net; tests/toolkit/runtime/
test_layouts.py: tp2 x ep2 and ep2 x pp2 give the data-parallel curve); on GPUs megatron's
GatedDeltaNet needs the fla package, a start-up check (toolkit.runtime.trainer.unsupported).
"""
from __future__ import annotations

from collections.abc import Iterator

from .rules import Context, Finding, error, rule, size_error


@rule
def linear_attention_heads(c: Context) -> Iterator[Finding]:
    """TransformerConfig: linear_num_key_heads and linear_num_value_heads are multiples of tp
    (GatedDeltaNet splits its heads over tp)."""
    la, tp = c.shape.linear_attention, c.layout.tp
    if la is None:
        return
    for name, n in (("linear_num_key_heads", la.key_heads), ("linear_num_value_heads", la.value_heads)):
        if n % tp:
            yield size_error(f"tp={tp} does not divide {name}={n} (gated delta net heads)")


@rule
def linear_attention_context_parallel(c: Context) -> Iterator[Finding]:
    """TransformerConfig asserts context_parallel_size == 1 with gated delta net ('does not support
    context parallel for now'; gated_delta_net.py: 'TODO: Implement GatedDeltaNetContextParallel')."""
    if c.shape.linear_attention is not None and c.layout.cp > 1:
        yield error(f"cp={c.layout.cp} with gated delta net layers: megatron-core 0.16.1 has no context parallelism "
                    "for them (TransformerConfig asserts cp=1; GatedDeltaNetContextParallel is a TODO); use cp=1")


@rule(scope="training")
def linear_attention_packing(c: Context) -> Iterator[Finding]:
    """GatedDeltaNet.forward raises NotImplementedError for packed sequences (packed_seq_params)
    and takes no attention mask: its recurrent state would run across packed conversations."""
    if c.shape.linear_attention is not None and c.spec.data.packing:
        yield error("data.packing with gated delta net layers: megatron-core 0.16.1's GatedDeltaNet does not support "
                    "packed sequences (NotImplementedError) and ignores attention masks, so its state would cross "
                    "conversations; use data.packing=false")
