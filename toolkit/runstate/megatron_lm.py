"""Megatron-LM's torch_dist checkpoint with distributed-optimizer state <-> the runtime's.

Megatron-LM (``--ckpt-format torch_dist --use-distributed-optimizer
--dist-ckpt-optim-fully-reshardable``) writes ``ROOT/latest_checkpointed_iteration.txt`` and
``ROOT/iter_<7 digits>/``: one DCP folder holding the model's tensors and, under
``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``, the fp32 master and Adam moments
of every parameter as global tensors (megatron-core's ``DistributedOptimizer.sharded_state_dict``
with ``distrib_optim_sharding_type = fully_reshardable``), and ``common.pt`` with ``args``,
``iteration``, ``checkpoint_version``, the optimizer's param groups (``optimizer``),
``opt_param_scheduler`` and the ``content_metadata`` its loader passes back to
``sharded_state_dict``. The runtime keeps the same keys, split in two folders (``model/``,
``optimizer/``), so a conversion copies the DCP records byte for byte (converters.formats.dcp.select) and
rewrites the small common files. Megatron-LM's default ``dp_reshardable`` layout stores the
optimizer's internal buckets (readable only by the same tp/pp layout) and is refused.
A model with experts gets Megatron-LM's chained form (dense and expert optimizers, index 0, 1).
"""
from __future__ import annotations

import shutil
from argparse import Namespace
from pathlib import Path

from converters.formats import dcp

from ..errors import InputFileError
from ..runtime.optim_state import SHARDING, saved_step
from .runtime_ckpt import SIDE, RunCheckpoint, finish_run, load_common, write_torch_dist_files

TRACKER = "latest_checkpointed_iteration.txt"
OPTIMIZER_KEYS = "optimizer.state."
CONTENT = {"distrib_optim_sharding_type": SHARDING, "distrib_optim_fully_reshardable_mem_efficient": False,
           "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def iteration_dir(root: Path, step: int) -> Path:
    return root / f"iter_{step:07d}"


def find_iteration(path: str | Path) -> Path:
    """The iteration folder of a Megatron-LM checkpoint ROOT (its tracker file), or the folder itself."""
    p = Path(path)
    if (p / TRACKER).is_file():
        it = (p / TRACKER).read_text().strip()
        p = p / "release" if it == "release" else iteration_dir(p, int(it))
    if not (p / "common.pt").is_file() or not (p / dcp.METADATA).is_file():
        raise InputFileError(f"'{p}' is not a Megatron-LM torch_dist checkpoint (no common.pt / .metadata)")
    return p


# ---------------------------------------------------------------------------- runtime -> Megatron-LM
def _optimizer_common(opt: dict) -> dict:
    """The runtime's optimizer common state; Megatron-LM's chained form when experts have their own groups."""
    groups = opt["optimizer"]["param_groups"]
    dense = [g for g in groups if not g.get("is_expert_parallel")]
    experts = [g for g in groups if g.get("is_expert_parallel")]
    if not experts:
        return opt
    part = lambda gs: {"optimizer": {"param_groups": gs}, "param_state_sharding_type": SHARDING}  # noqa: E731
    return {0: part(dense), 1: part(experts)}


def megatron_lm_args(ck: RunCheckpoint, state: dict, step: int) -> Namespace:
    from converters.megatron_args import megatron_args
    from toolkit.models import shape_from_hf
    from toolkit.parallel.layout import Layout

    lay = state.get("layout", {})
    layout = Layout(tp=lay.get("tp", 1), pp=lay.get("pp", 1), vpp=lay.get("vpp", 1), ep=lay.get("ep", 1),
                    etp=lay.get("etp") if lay.get("etp") not in (None, lay.get("tp", 1)) else None)
    dtype = dcp.tensors(ck.model)["embedding.word_embeddings.weight"].dtype
    args = megatron_args(shape_from_hf(ck.hf_config()), layout, dtype=dtype, fmt="torch_dist")
    groups = ck.optimizer_common()["optimizer"]["param_groups"]
    first = groups[0]
    vars(args).update(
        use_distributed_optimizer=True, dist_ckpt_optim_fully_reshardable=True, use_dist_ckpt=True, optimizer="adam",
        iteration=step, consumed_train_samples=state["consumed_samples"], global_batch_size=state.get("global_batch"),
        seed=state.get("seed", 1234), lr=first.get("lr"), weight_decay=max(g.get("weight_decay", 0.0) for g in groups),
        adam_beta1=first.get("betas", (0.9, 0.999))[0], adam_beta2=first.get("betas", (0.9, 0.999))[1],
        adam_eps=first.get("eps", 1e-8), context_parallel_size=lay.get("cp", 1))
    if state.get("seq_len"):
        args.seq_length = state["seq_len"]
    args.params_dtype = getattr(args.params_dtype, "torch", args.params_dtype)  # torch.save pickles torch's dtype
    return args


def runtime_to_megatron_lm(ck: RunCheckpoint, out_root: Path, progress=None) -> Path:
    state = ck.state
    step = saved_step(ck.optimizer_common())
    it = iteration_dir(out_root, step)
    it.mkdir(parents=True)
    dcp.select([dcp.Source(ck.model, lambda k: True), dcp.Source(ck.optimizer, lambda k: True)], it, progress)
    common = {"args": megatron_lm_args(ck, state, step), "checkpoint_version": 3.0, "iteration": step,
              "optimizer": _optimizer_common(ck.optimizer_common()), "num_floating_point_operations_so_far": 0,
              "content_metadata": dict(CONTENT)}
    if state.get("lr_scheduler"):
        common["opt_param_scheduler"] = state["lr_scheduler"]
    write_torch_dist_files(it, common)
    shutil.copytree(ck.model / SIDE, it / SIDE)
    (out_root / TRACKER).write_text(f"{step}\n")
    return it


# ---------------------------------------------------------------------------- Megatron-LM -> runtime
def _flat_optimizer(opt) -> dict:
    """One runtime optimizer common state from Megatron-LM's (plain or chained) one; refuses
    the layouts whose tensors are not per-parameter global tensors."""
    parts = [opt[k] for k in sorted(opt)] if all(isinstance(k, int) for k in opt) else [opt]
    kinds = {p.get("param_state_sharding_type") for p in parts}
    if kinds != {SHARDING}:
        raise InputFileError(f"the distributed optimizer state is stored as {sorted(map(str, kinds))}; only "
                             f"'{SHARDING}' holds one global tensor per parameter (save it with Megatron-LM's "
                             "--dist-ckpt-optim-fully-reshardable)")
    groups = [g for p in parts for g in p["optimizer"]["param_groups"]]
    return {"optimizer": {"param_groups": groups}, "param_state_sharding_type": SHARDING}


def _model_key(key: str) -> bool:
    return not key.startswith(("optimizer.", "rng_state", "rerun_state"))


def _train_state(common: dict, step: int) -> dict:
    from converters import layout_from_args

    args = common.get("args")
    sched = common.get("opt_param_scheduler") or {}
    consumed = getattr(args, "consumed_train_samples", None)
    consumed = sched.get("num_steps", 0) if consumed is None else consumed
    lay = layout_from_args(args) if args is not None else None
    state = {"step": step, "consumed_samples": int(consumed), "lr_scheduler": sched or None,
             "layout": {"tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "ep": lay.ep, "etp": lay.expert_tp} if lay else {}}
    for field, arg in (("seed", "seed"), ("global_batch", "global_batch_size"), ("seq_len", "seq_length")):
        if getattr(args, arg, None) is not None:
            state[field] = getattr(args, arg)
    return state


def megatron_lm_to_runtime(src: Path, out_root: Path, hf_config: dict | None = None, progress=None) -> Path:
    from converters import shape_from_args
    from toolkit.models import hf_config_dict

    common = load_common(src)
    if "optimizer" not in common:
        raise InputFileError(f"'{src}' holds no optimizer state (saved with --no-save-optim?)")
    opt = _flat_optimizer(common["optimizer"])
    step = int(common.get("iteration", saved_step(opt)))
    folder = out_root / f"global_step{step}"
    for part, keep in (("model", _model_key), ("optimizer", lambda k: k.startswith(OPTIMIZER_KEYS))):
        (folder / part).mkdir(parents=True)
        dcp.select([dcp.Source(src, keep)], folder / part, progress)
    write_torch_dist_files(folder / "model", {})
    write_torch_dist_files(folder / "optimizer", {"optimizer": opt})
    side = src / SIDE if (src / SIDE / "config.json").is_file() else hf_config_dict(
        shape_from_args(common.get("args"), hf_config))
    return finish_run(out_root, step, _train_state(common, step), side)

