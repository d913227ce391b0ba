"""Not a test module: megatron-core's own DistributedOptimizer on CPU ranks, for the Megatron-LM
checks (run by tests/support/runtime_worker.py items with "megatron_optimizer").

It builds the model at tp = pp = 1 (megatron-core's GPTModel), wraps it in megatron-core's
DistributedDataParallel and DistributedOptimizer (``get_megatron_optimizer``, torch's Adam:
no TransformerEngine or Apex here) over the data-parallel ranks, and does what Megatron-LM's
load_checkpoint and save_checkpoint do with ``--dist-ckpt-optim-fully-reshardable``:
``sharded_state_dict(..., metadata={"distrib_optim_sharding_type": "fully_reshardable"})``,
megatron's ``dist_checkpointing.load`` / ``save``, ``load_state_dict``. It writes
  OUT/megatron_keys.json: {key: global shape} of every tensor the optimizer's sharded state
    dict asks for when loading;
  OUT/optim/load_step<N>/: the state it loaded, as its own fully-reshardable save gathers it
    (tests/support/optimizer_dump.py's format);
  item["save"]: a Megatron-LM checkpoint written by megatron's save of that state.

megatron-core 0.16.1's optimizer assumes CUDA and TransformerEngine (or Apex) in a few places,
changed only while it runs here (``cpu_shims``): tensors created with ``device='cuda'`` in
MixedPrecisionOptimizer.__init__ are made on the CPU; ``Tensor.type()`` answers
'torch.cuda.FloatTensor' for CPU float tensors (the parameter dtype checks); and the step is
kept where TransformerEngine's FusedAdam keeps it, in the param groups
(``distrib_optimizer.USING_TE_OPTIMIZER``, and torch's AdamW as the inner optimizer without
its ``__setstate__``, which insists on a per-parameter step): with torch's Adam as it is,
``state_dict`` needs a step in every parameter's state and the fully-reshardable load then
fails on it (``_set_main_param_and_optimizer_states`` copies every state key, and the loaded
tensors have no "step": KeyError). The fresh optimizer's state is megatron's own
``init_state_fn`` (zero moments), as Megatron-LM's load starts from.
"""
from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True}


class _CpuTorch:
    """The torch module, with device='cuda' tensor factories made on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, device=None, **kwargs):
        return torch.tensor(*args, device="cpu" if device == "cuda" else device, **kwargs)


@contextlib.contextmanager
def cpu_shims():
    from megatron.core.optimizer import distrib_optimizer as dist_module
    from megatron.core.optimizer import optimizer as opt_module

    real = torch.Tensor.type, opt_module.torch, dist_module.HAVE_APEX_OR_TE, dist_module.USING_TE_OPTIMIZER

    def cuda_type(self, *args, **kwargs):
        name = real[0](self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs and "cuda" not in name else name

    torch.Tensor.type, opt_module.torch = cuda_type, _CpuTorch()
    dist_module.HAVE_APEX_OR_TE = dist_module.USING_TE_OPTIMIZER = True
    try:
        yield
    finally:
        torch.Tensor.type, opt_module.torch, dist_module.HAVE_APEX_OR_TE, dist_module.USING_TE_OPTIMIZER = real


class _StepInGroups(torch.optim.AdamW):
    """torch's AdamW holding no per-parameter step (TransformerEngine's FusedAdam's layout)."""

    def __setstate__(self, state):
        torch.optim.Optimizer.__setstate__(self, state)


def build(plan):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from toolkit.runtime.model import build_model_chunks

    gpt = build_model_chunks(plan, zero=False)[0]
    o = plan.spec.optimizer
    ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(use_distributed_optimizer=True), gpt)
    cfg = OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                          adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_eps=o.eps, clip_grad=o.clip_grad,
                          use_distributed_optimizer=True, bf16=False, fp16=False, params_dtype=torch.float32)
    opt = get_megatron_optimizer(cfg, [ddp])
    for inner in _inner(opt):
        inner.optimizer.__class__ = _StepInGroups
        inner.init_state_fn(inner.optimizer, inner.config)
    return gpt, opt


def _inner(opt) -> list:
    return getattr(opt, "chained_optimizers", [opt])


def _tensors(tree) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = []
    for v in nested_values(tree):
        if isinstance(v, ShardedTensorFactory):
            out += [t for t in nested_values(v.build()) if isinstance(t, ShardedTensor)]
        elif isinstance(v, ShardedTensor):
            out.append(v)
    return out


def _dump(param_state: dict, step: int, out: Path) -> None:
    """The gathered model-space states ({i: {param, exp_avg, exp_avg_sq}}) as optimizer_dump parts."""
    parts = []
    for states in param_state.values():
        built = {k: _tensors({k: replace(v, data=v.data.clone())}) for k, v in states.items()}
        for i, sh in enumerate(built["param"]):
            parts.append({"key": sh.key.split(".", 3)[3], "global_shape": tuple(sh.global_shape),
                          "offset": tuple(sh.global_offset), **{k: built[k][i].data for k in built}})
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"step": step, "parts": parts}, out / "rank0.pt")


def run_megatron_optimizer(plan, item: dict, out: Path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from toolkit.mcore.distributed import init_parallel
    from toolkit.parallel.layout import Layout

    init_parallel(Layout(), plan.spec.train.seed)
    src, save = Path(item["megatron_optimizer"]["load"]), Path(item["megatron_optimizer"]["save"])
    with cpu_shims():
        gpt, opt = build(plan)
        meta = {**SHARDING, "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
        model_sd = gpt.sharded_state_dict()
        request = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True, metadata=meta)}
        if dist.get_rank() == 0:
            keys = {t.key: list(t.global_shape) for t in _tensors(request["optimizer"])}
            out.mkdir(parents=True, exist_ok=True)
            (out / "megatron_keys.json").write_text(json.dumps(keys, indent=1) + "\n")
        with torch.serialization.safe_globals([argparse.Namespace]):  # Megatron-LM's args in common.pt
            loaded = dist_checkpointing.load(request, str(src))
        gpt.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        step = int(loaded["iteration"])
        gathered = opt.sharded_state_dict(gpt.sharded_state_dict(), is_loading=False,
                                          metadata={**meta, "distrib_optim_fully_reshardable_mem_efficient": True})
        if dist.get_rank() == 0:  # the step as megatron's optimizer holds it after loading
            _dump(gathered["param_state"], int(gathered["optimizer"]["param_groups"][0]["step"]),
                  out / "optim" / f"load_step{step}")
        common = {k: loaded[k] for k in ("args", "checkpoint_version", "iteration", "opt_param_scheduler",
                                         "num_floating_point_operations_so_far") if k in loaded}
        it = save / f"iter_{step:07d}"
        if dist.get_rank() == 0:
            it.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save({**common, "model": gpt.sharded_state_dict(), "optimizer": gathered}, str(it),
                                content_metadata={k: v for k, v in meta.items() if k != "dp_cp_group"})
        if dist.get_rank() == 0:
            (save / "latest_checkpointed_iteration.txt").write_text(f"{step}\n")
    dist.barrier()
