"""Memory traffic of a Hugging Face Llama decoder layer run eagerly (no torch.compile): the bytes
every non-GEMM, non-attention aten op reads and writes (its tensor inputs and outputs; views
move nothing), forward and backward, per token and per unit of hidden size. On a GPU each such
op is one kernel reading its inputs from and writing its outputs to HBM, which is what eager
PyTorch (transformers' modules, torchtitan without compile) costs beside the fused kernels the
planner times (compute.layer_work: (2 norms + 6) h + 2 (heads + groups) d + 3 ffn elements
forward, twice that backward).

    PYTHONPATH=. python benchmarks/eager_traffic.py [--hidden 256 --heads 8 --groups 2 --head-dim 32 --ffn 896]
    PYTHONPATH=. python benchmarks/eager_traffic.py --loss 1000   # transformers' causal-LM loss, per logit
    PYTHONPATH=. python benchmarks/eager_traffic.py --megatron-loss 1000   # megatron-core's unfused loss

The default shape has Llama-3-8B's proportions (groups = heads / 4, ffn = 3.5 h). Counted on
the CPU with transformers' own LlamaDecoderLayer in bf16 and torch's SDPA (excluded, as are
mm/addmm/bmm); not used by the planner (the estimate of eager runs is not done: docs/planner.md).
"""
from __future__ import annotations

import argparse

VIEWS = {"t", "transpose", "unsqueeze", "expand", "slice", "detach", "_unsafe_view", "permute", "split", "select",
         "alias", "as_strided", "squeeze", "reshape", "view"}
TIMED_ELSEWHERE = ("mm", "addmm", "bmm", "_scaled_dot_product", "scaled_dot_product", "_efficient_attention",
                   "_flash_attention")


def counter():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func.__name__.split(".")[0]
            if name in VIEWS or name.startswith(TIMED_ELSEWHERE):
                return out
            read = {k: v for k, v in kwargs.items() if k != "out"}  # an out= tensor is written, not read
            tensors = [t for t in tree_leaves((args, read, out)) if isinstance(t, torch.Tensor)]
            self.bytes[name] = self.bytes.get(name, 0) + sum(t.numel() * t.element_size() for t in tensors)
            return out

    return Count


def measure(hidden: int, heads: int, groups: int, head_dim: int, ffn: int, tokens: int) -> tuple[dict, dict]:
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaDecoderLayer,
        LlamaRotaryEmbedding,
    )

    cfg = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=groups, head_dim=head_dim,
                      intermediate_size=ffn, num_hidden_layers=1)
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, 0).to(torch.bfloat16)
    x = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(tokens)[None]
    cos_sin = LlamaRotaryEmbedding(cfg)(x, pos)
    Count = counter()
    fwd, bwd = Count(), Count()
    with fwd:
        y = layer(x, position_embeddings=cos_sin, attention_mask=None, position_ids=pos)
    y = y[0] if isinstance(y, tuple) else y
    with bwd:
        y.backward(torch.ones_like(y))
    return fwd.bytes, bwd.bytes


def measure_loss(tokens: int, vocab: int) -> tuple[dict, dict]:
    """Bytes of transformers' ForCausalLMLoss (the HF Trainer's causal-LM loss) on bf16 logits of
    ``tokens`` x ``vocab``, forward and backward, by aten op. As counted, nll_loss's input is read
    whole; its kernels read (and its backward scatters into) one entry per token."""
    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits = torch.randn(1, tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    Count = counter()
    fwd, bwd = Count(), Count()
    with fwd:
        loss = ForCausalLMLoss(logits, labels, vocab)
    with bwd:
        loss.backward()
    return fwd.bytes, bwd.bytes


def measure_megatron_loss(tokens: int, vocab: int) -> tuple[dict, dict]:
    """Bytes of megatron-core's vocab_parallel_cross_entropy (GPTModel's loss with
    cross_entropy_loss_fusion off, LanguageModule.compute_language_model_loss) on bf16 logits
    [tokens, 1, vocab] and the gradient of every token's loss, forward and backward, by aten op; in a
    one-rank tensor-parallel group, which the caller initialises (megatron's parallel_state). As
    counted, the gather of each token's target logit and the backward's scatter into it take their
    whole tensor; their kernels touch one entry per token."""
    import torch
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = torch.randn(tokens, 1, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens, 1))
    Count = counter()
    fwd, bwd = Count(), Count()
    with fwd:
        loss = vocab_parallel_cross_entropy(logits, labels)
    with bwd:
        loss.backward(torch.ones_like(loss))
    return fwd.bytes, bwd.bytes


def one_rank_world():
    """megatron's parallel state over this process alone (gloo), for measure_megatron_loss."""
    import os

    from toolkit.mcore import distributed
    from toolkit.mcore.rendezvous import one_process_env
    from toolkit.parallel.layout import Layout

    os.environ.update(one_process_env())
    distributed.init_parallel(Layout())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 256), ("heads", 8), ("groups", 2), ("head-dim", 32), ("ffn", 896),
                          ("tokens", 64)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--loss", type=int, metavar="VOCAB", help="count the loss over VOCAB logits per token instead")
    ap.add_argument("--megatron-loss", type=int, metavar="VOCAB", help="count megatron-core's unfused vocab-parallel "
                    "cross entropy over VOCAB logits per token instead")
    a = ap.parse_args()
    if a.loss or a.megatron_loss:
        if a.megatron_loss:
            one_rank_world()
        vocab = a.megatron_loss or a.loss
        fwd, bwd = (measure_megatron_loss if a.megatron_loss else measure_loss)(a.tokens, vocab)
        per = a.tokens * vocab
        for label, d in (("forward", fwd), ("backward", bwd)):
            print(f"loss {label}: " + ", ".join(f"{k} {v / per:.2f}" for k, v in d.items()) + " bytes per logit")
        return
    fwd, bwd = measure(a.hidden, a.heads, a.groups, a.head_dim, a.ffn, a.tokens)
    per = a.tokens * a.hidden
    fused = 2 * ((2 * 2 + 6) * a.hidden + 2 * (a.heads + a.groups) * a.head_dim + 3 * a.ffn)  # bf16, forward
    print(f"eager forward {sum(fwd.values()) / per:.1f} h, backward {sum(bwd.values()) / per:.1f} h bytes per token; "
          f"the planner's fused model {fused / a.hidden:.1f} h and {2 * fused / a.hidden:.1f} h")
    for label, d in (("forward", fwd), ("backward", bwd)):
        top = sorted(d.items(), key=lambda kv: -kv[1])[:8]
        print(f"  {label}: " + ", ".join(f"{k} {v / per:.1f} h" for k, v in top))


if __name__ == "__main__":
    main()
