"""Not a test module: tests/toolkit/mcore/test_context_parallel.py launches it on 4 ranks with
torch.distributed.run (gloo). It checks ContextParallelAttention against megatron-core itself
and prints, on rank 0, one JSON line per check with the largest differences over all ranks:

- module: for each layout (tp1 cp2 dp2, tp1 cp4 with hierarchical cp [2, 2], tp2 cp2) and
  cp_comm_type, the output and the gradients of q, k, v on this rank's tokens against
  megatron's DotProductAttention run on the whole sequence (its rows in this rank's order),
  and the host reads of a tensor (``.item()``, ``bool()``: a wait for the GPU on CUDA) in a
  second forward and backward (tests/support/host_syncs.py);
- model: megatron-core's GPTModel built the way toolkit/mcore/model.py builds it, at cp > 1
  with the swapped spec, against the same GPTModel at cp = 1 (same weights, same tokens):
  logits gathered back to sequence order and parameter gradients (summed over cp);
- refusals: the messages of what the module refuses.

    python -m torch.distributed.run --nproc_per_node 4 tests/support/context_parallel_worker.py [module|model|refusal ...]
"""
from __future__ import annotations

import contextlib
import json
import sys
import time

import torch
import torch.distributed as dist
from host_syncs import HostSyncs

S, B, HEADS, GROUPS, D = 16, 2, 8, 4, 8  # module checks: sequence, batch, heads, query groups, head size
MODEL_SEQ = 64


def emit(record: dict) -> None:
    """Largest value of each float over all ranks; rank 0 prints the record."""
    keys = [k for k, v in record.items() if isinstance(v, float)]
    if keys:
        t = torch.tensor([record[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        record.update(zip(keys, t.tolist()))
    if dist.get_rank() == 0:
        print("CHECK " + json.dumps(record), flush=True)


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# ------------------------------------------------------------------------- megatron on this CPU
@contextlib.contextmanager
def cuda_ones_on_cpu():
    """megatron's get_sliding_window_causal_mask allocates on "cuda": build it on CPU instead."""
    real = torch.ones
    torch.ones = lambda *a, device=None, **k: real(*a, device="cpu" if device == "cuda" else device, **k)
    try:
        yield
    finally:
        torch.ones = real


def setup(tp: int, cp: int, hcp: list[int] | None = None) -> None:
    from megatron.core import parallel_state

    from toolkit.mcore.distributed import release_model_parallel, seed_streams

    start = time.perf_counter()
    release_model_parallel()  # the previous grid's groups: no gloo threads left behind
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                             hierarchical_context_parallel_sizes=hcp,
                                             create_gloo_process_groups=False)
    seed_streams(1234)  # megatron's attention forks its tracker's model-parallel stream
    if dist.get_rank() == 0:
        print(f"TIME setup tp{tp} cp{cp}: {time.perf_counter() - start:.1f} s", flush=True)


def cp_slice(x: torch.Tensor, dim: int) -> torch.Tensor:
    """This cp rank's part of `x` along `dim`: megatron's own get_batch_on_this_cp_rank."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    x = x.movedim(dim, 1)
    return get_batch_on_this_cp_rank({"x": x})["x"].movedim(1, dim)


# ---------------------------------------------------------------------------- module checks
def attention_config(tp, cp, dtype, hcp=None, **over):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from toolkit.mcore.cpu_compat import CPU_CONFIG

    fields = dict(num_layers=4, hidden_size=64, num_attention_heads=HEADS, num_query_groups=GROUPS, kv_channels=D,
                  tensor_model_parallel_size=tp, context_parallel_size=cp, hierarchical_context_parallel_sizes=hcp,
                  attention_dropout=0.0, bf16=dtype == torch.bfloat16, params_dtype=dtype, **CPU_CONFIG)
    fields.update(over)
    return TransformerConfig(**fields)


def full_inputs(tp_rank: int, heads: int, groups: int):
    """q, k, v on the whole sequence and the output gradient, the same on every rank of a tp rank."""
    g = torch.Generator().manual_seed(100 + tp_rank)
    q = torch.randn(S, B, heads, D, generator=g)
    k, v = (torch.randn(S, B, groups, D, generator=g) for _ in range(2))
    return q, k, v, torch.randn(S, B, heads * D, generator=g)


def run(module, q, k, v, dout, mask):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, mask)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def module_check(layout: str, tp: int, cp: int, hcp, kind: str, dtype=torch.float32, mask="cp", window=None,
                 layer=1, groups=GROUPS, **over) -> None:
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from toolkit.mcore.context_parallel import ContextParallelAttention

    build = dict(layer_number=layer, attn_mask_type=AttnMaskType.causal, attention_type="self")
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    q, k, v, dout = full_inputs(tp_rank, HEADS // tp, groups // tp)
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)[None, None]
    ref_results = {}
    for ref_dtype in {torch.float32, dtype}:
        ref = DotProductAttention(attention_config(tp, 1, ref_dtype, num_query_groups=groups, window_size=window,
                                                   **over), **build)
        with cuda_ones_on_cpu():  # the window case: megatron builds its own mask, on "cuda"
            ref_results[ref_dtype] = run(ref, *(t.to(ref_dtype) for t in (q, k, v, dout)), causal)
    module = ContextParallelAttention(attention_config(tp, cp, dtype, hcp, num_query_groups=groups,
                                                       window_size=window, **over), cp_comm_type=kind, **build)
    local_mask = cp_slice(causal, 2) if mask == "cp" else None
    mine = run(module, *(cp_slice(t, 0).to(dtype) for t in (q, k, v, dout)), local_mask)
    with HostSyncs() as syncs:  # a second step: what the first one decided is kept
        run(module, *(cp_slice(t, 0).to(dtype) for t in (q, k, v, dout)), local_mask)
    record = {"check": "module", "layout": layout, "kind": kind, "dtype": str(dtype)[6:], "mask": mask,
              "window": window, "groups": groups, "layer": layer, **{k: str(v) for k, v in over.items()},
              "host_reads": float(syncs.reads)}
    for name, a, r32, rd in zip(("out", "dq", "dk", "dv"), mine, ref_results[torch.float32], ref_results[dtype]):
        r32 = cp_slice(r32.float(), 0)
        record[name] = maxdiff(a, r32)
        record[name + "_scale"] = r32.abs().max().item()
        if dtype != torch.float32:
            record[name + "_megatron_" + str(dtype)[6:]] = maxdiff(cp_slice(rd, 0), r32)
    emit(record)


def module_checks() -> None:
    layouts = [("tp1 cp2 dp2", 1, 2, None), ("tp1 cp4 hcp[2,2]", 1, 4, [2, 2]), ("tp2 cp2", 2, 2, None)]
    for layout, tp, cp, hcp in layouts:
        setup(tp, cp, hcp)
        kinds = ["p2p", "all_gather", "a2a"] + (["a2a+p2p"] if hcp else [])
        for kind in kinds:
            module_check(layout, tp, cp, hcp, kind)
            module_check(layout, tp, cp, hcp, kind, dtype=torch.bfloat16)
            module_check(layout, tp, cp, hcp, kind, mask=None)
            if tp == 1:
                module_check(layout, tp, cp, hcp, kind, window=(5, 0))
                module_check(layout, tp, cp, hcp, kind, groups=HEADS)  # no GQA
        if cp == 2 and tp == 1:
            for kind in ("p2p", "all_gather", "a2a"):  # megatron's layer scaling: softmax_scale / layer, x layer
                module_check(layout, tp, cp, hcp, kind, layer=3, apply_query_key_layer_scaling=True)


# ----------------------------------------------------------------------------- model checks
def tiny_plan(tp: int, cp: int):
    from toolkit.plan import make_plan
    from toolkit.spec import TrainingSpec

    return make_plan(TrainingSpec.from_dict({
        "model": "llama-tiny", "cluster": {"nodes": 1, "gpus_per_node": dist.get_world_size(), "gpu": "cpu"},
        "parallel": {"tp": tp, "cp": cp}, "precision": "fp32", "recompute": "none",
        "batch": {"micro": B, "global": 8 * B, "seq_len": MODEL_SEQ}})).require_valid()


def build_gpt(plan, swap: bool = True, **config_overrides):
    """GPTModel as toolkit/mcore/model.py builds it; `swap`: with ContextParallelAttention."""
    from megatron.core.models.gpt import GPTModel

    from toolkit.emit.megatron import gpt_model_kwargs
    from toolkit.mcore import model
    from toolkit.mcore.context_parallel import context_parallel_spec

    config = model.transformer_config(plan, **config_overrides)
    spec = model.block_spec(plan, config, None)
    spec = context_parallel_spec(spec) if swap else spec
    return GPTModel(config=config, transformer_layer_spec=spec, pre_process=True, post_process=True,
                    **gpt_model_kwargs(plan))


def model_inputs(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (B, MODEL_SEQ), generator=g)
    return {"tokens": tokens, "labels": tokens.roll(-1, 1), "position_ids": torch.arange(MODEL_SEQ).expand(B, -1),
            "attention_mask": torch.triu(torch.ones(MODEL_SEQ, MODEL_SEQ, dtype=torch.bool), 1)[None, None]}


def model_pass(gpt, batch, mask) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits [b, s_local, vocab/tp] and gradients of the summed per-token loss; gradients of
    sequence-parallel weights (norms) all-reduced over tp, as megatron's finalize_model_grads does."""
    from megatron.core import parallel_state

    gpt.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = gpt(batch["tokens"], batch["position_ids"], mask)
    gpt(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"]).sum().backward()
    grads = {}
    for name, p in gpt.named_parameters():
        grads[name] = p.grad.clone()
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(grads[name], group=parallel_state.get_tensor_model_parallel_group())
    return logits, grads


def model_checks() -> None:
    from megatron.core import parallel_state

    for tp, cases in [(1, [(2, None, "p2p", "cp"), (2, None, "p2p", None), (2, None, "all_gather", "cp"),
                           (2, None, "a2a", "cp"), (4, [2, 2], "a2a+p2p", "cp"), (4, [2, 2], "p2p", "cp")]),
                      (2, [(2, None, "p2p", "cp"), (2, None, "all_gather", "cp")])]:
        setup(tp, 1)
        torch.manual_seed(0)
        ref = build_gpt(tiny_plan(tp, 1), swap=False)  # megatron's own DotProductAttention
        weights = {k: v.clone() if torch.is_tensor(v) else v for k, v in ref.state_dict().items()}
        batch = model_inputs(512)
        ref_logits, ref_grads = model_pass(ref, batch, batch["attention_mask"])
        same = build_gpt(tiny_plan(tp, 1))  # at cp = 1 the swapped spec is megatron's forward, bit for bit
        same.load_state_dict(weights)
        logits, grads = model_pass(same, batch, batch["attention_mask"])
        emit({"check": "model", "layout": f"tp{tp} cp1", "kind": "swapped spec", "mask": "full",
              "logits": maxdiff(logits, ref_logits), "grads": max(maxdiff(grads[n], ref_grads[n]) for n in grads)})
        for cp, hcp, kind, mask in cases:
            setup(tp, cp, hcp)
            gpt = build_gpt(tiny_plan(tp, cp), cp_comm_type=kind, hierarchical_context_parallel_sizes=hcp)
            gpt.load_state_dict(weights)
            local = {k: cp_slice(v, 2 if k == "attention_mask" else 1) for k, v in batch.items()}
            logits, grads = model_pass(gpt, local, local["attention_mask"] if mask == "cp" else None)
            cp_group = parallel_state.get_context_parallel_group()
            for g in grads.values():
                dist.all_reduce(g, group=cp_group)
            emit({"check": "model", "layout": f"tp{tp} cp{cp}" + (f" hcp{hcp}" if hcp else ""), "kind": kind,
                  "mask": mask, "logits": maxdiff(logits, cp_slice(ref_logits, 1)),
                  "logits_scale": ref_logits.abs().max().item(),
                  "grads": max(maxdiff(grads[n], ref_grads[n]) for n in grads),
                  "grads_scale": max(g.abs().max().item() for g in ref_grads.values()),
                  "params": len(grads)})


# --------------------------------------------------------------------------------- refusals
def refusal_checks() -> None:
    from megatron.core.transformer.enums import AttnMaskType

    from toolkit.mcore.context_parallel import ContextParallelAttention

    build = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    setup(2, 2)
    attempts = {
        "a2a_heads": lambda: ContextParallelAttention(attention_config(2, 2, torch.float32, num_query_groups=2),
                                                      cp_comm_type="a2a", **build),
        "p2p_dropout": lambda: ContextParallelAttention(attention_config(2, 2, torch.float32, attention_dropout=0.1),
                                                        cp_comm_type="p2p", **build),
        "no_hierarchy": lambda: ContextParallelAttention(attention_config(2, 2, torch.float32),
                                                         cp_comm_type="a2a+p2p", **build),
        "local_mask": lambda: ContextParallelAttention(attention_config(2, 2, torch.float32), cp_comm_type="p2p",
                                                       **build)(*full_inputs(0, 4, 2)[:3], torch.ones(
                                                           1, 1, S, S, dtype=torch.bool)),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            message = None
        except Exception as e:  # noqa: BLE001 - the test reads the type and message
            message = f"{type(e).__name__}: {e}"
        emit({"check": "refusal", "case": name, "message": message})


def main() -> None:
    import deepspeed

    from toolkit.mcore import cpu_compat

    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo")  # a2a uses deepspeed.comm, as under the runtime
    cpu_compat.apply()  # also megatron's rope cp slicing and sliding-window mask on the CPU
    torch.set_num_threads(1)
    for section in sys.argv[1:] or ["module", "model", "refusal"]:
        start = time.perf_counter()
        {"module": module_checks, "model": model_checks, "refusal": refusal_checks}[section]()
        if dist.get_rank() == 0:
            print(f"TIME {section} checks: {time.perf_counter() - start:.1f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
