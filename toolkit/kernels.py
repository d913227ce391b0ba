"""What a spec builds: the kernels the memory estimate counts and the runtime constructs.

Read by both sides (toolkit.estimate.memory and toolkit.mcore.model), so the estimate is of
the model that runs. The target is the spec's ``cluster.gpu``: a CUDA GPU, or "cpu" (the
tiny CPU flavour and tests).

  attention "flash"    megatron-core's TransformerEngine layer spec (TEDotProductAttention
                       with ``attention_backend=flash``): q, k, v and the output are kept,
                       no s x s score matrix. Needs CUDA and TransformerEngine.
  attention "unfused"  megatron-core's local layer spec (DotProductAttention): the fp32
                       softmax output and the 16-bit probabilities (a x s per token) are
                       kept, and k, v are expanded to every query head (GQA) before the
                       matmuls, so the expanded copies are kept too.
  fused SwiGLU         CUDA: megatron's ``bias_swiglu`` kernel (``bias_activation_fusion``)
                       keeps only its input (2f). Otherwise megatron's ``glu`` keeps the
                       fc1 output (2f), silu's output, the linear half plus its offset and
                       the product (f each).
  fused RMSNorm        CUDA: TransformerEngine's or torch's fused RMSNorm keeps its input and
                       the fp32 reciprocal RMS. CPU: torch's composite RMSNorm keeps two fp32
                       working copies (input and normalised input) whatever the dtype.
  fused dropout        CUDA: torch's dropout is its fused ``native_dropout``, which keeps a
                       bool mask; CPU: input x scaled Bernoulli noise, which keeps the noise
                       in the input's dtype (ATen's is_fused_kernel_acceptable).
Nothing here imports torch: the planner stays light.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

CPU = "cpu"


@dataclass(frozen=True)
class Kernels:
    transformer_engine: bool  # megatron's TE layer spec (else the local spec)
    attention: str  # "flash" | "unfused"
    fused_swiglu: bool  # TransformerConfig.bias_activation_fusion
    fused_norm: bool  # RMSNorm keeps its 16-bit input + fp32 rstd (else two fp32 copies)
    fused_dropout: bool  # dropout keeps a bool mask (else the noise, in the input's dtype)

    def describe(self) -> str:
        spec = "TransformerEngine layer spec" if self.transformer_engine else "local layer spec"
        act = "fused SwiGLU" if self.fused_swiglu else "unfused SwiGLU"
        return f"{spec}, {self.attention} attention, {act}"


def attention(gpu: str, attention_backend: str) -> str:
    """``attention.backend`` resolved for the target: "auto" is flash on a GPU, unfused on cpu."""
    if attention_backend == "auto":
        return "unfused" if gpu == CPU else "flash"
    return attention_backend


def kernels(gpu: str, attention_backend: str) -> Kernels:
    """The kernels built for a target device (``cluster.gpu``) and ``attention.backend``."""
    cuda = gpu != CPU
    flash = attention(gpu, attention_backend) == "flash"
    return Kernels(transformer_engine=cuda and flash, attention="flash" if flash else "unfused",
                   fused_swiglu=cuda, fused_norm=cuda, fused_dropout=cuda)


def spec_kernels(spec) -> Kernels:
    return kernels(spec.cluster.gpu, spec.attention.backend)


def eager_fusions() -> None:
    """megatron-core's fused functions run eager in this process and its children: torch's own
    switch, TORCHDYNAMO_DISABLE=1 (``torch.compile`` returns the function as it is); a user's
    setting is kept. megatron decorates 41 functions with ``torch.compile`` when it is imported;
    compiled, each builds C++ at its first call (torch still imports dynamo and inductor to
    answer the decorators, and a run's first weight initialisation imports dynamo in any case:
    torch._refs' disable-dynamo wrappers); so only before megatron is imported. For CPU runs
    (toolkit.mcore.cpu_compat.eager_fusers) and conversions, which call none of them
    (``toolkit convert``, on any machine)."""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
