"""A parameter's optimizer state, whole, through DeepSpeed's own accessors.

Keys are Megatron-LM's: "param" (the fp32 master weight), "exp_avg", "exp_avg_sq". ZeRO-1/2,
DeepSpeed's bf16 optimizer and ZeRO-3 keep them partitioned over data parallel:
``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` assemble a
parameter's whole (tensor-parallel) state, a collective over its data-parallel group, and the
``safe_set_full_*`` counterparts write this rank's part from the whole. Without ZeRO (fp32
only, see the plan's rules) DeepSpeed steps the basic optimizer on the parameters themselves:
the master is the parameter and the moments are in ``optimizer.state``.

Adam creates its state at its first step; ``prime`` creates it before a resume (as that step
would: zero moments; for torch.optim optimizers from a step of a small copy, else one step of
the basic optimizer on zero gradients at learning rate 0, which moves no weight) and lets
DeepSpeed link its per-parameter views to it, as DeepSpeed does after a first real step.
The step count lives in the basic optimizer (per state or per group, by implementation).

DeepSpeed 0.19.8's ZeRO-1/2 optimizer steps its parameter groups one at a time and links
the accessors' views to the optimizer state right after the FIRST group's step, before the
other groups have any state, and never again: the accessors then fail for every parameter
outside the first group ("exp_avg not found in optimizer state fragment"). ``link`` redoes
that linking once every group has state (before reading and after ``prime``).
"""
from __future__ import annotations

import contextlib

import torch

KEYS = ("param", "exp_avg", "exp_avg_sq")


def _partitioned(param: torch.nn.Parameter) -> bool:
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")


def link(engine) -> None:
    """Let DeepSpeed link its per-parameter views to the optimizer state of every group
    (see the module docstring); a no-op for optimizers without such views."""
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def get_full(engine, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """{key: fp32 tensor of the parameter's shape} (collective over its data-parallel group
    when DeepSpeed partitions it)."""
    if _partitioned(param):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        return {"param": safe_get_full_fp32_param(param),
                **{k: safe_get_full_optimizer_state(param, k) for k in KEYS[1:]}}
    state = engine.optimizer.state[param]
    return {"param": param.detach(), **{k: state[k] for k in KEYS[1:]}}


def set_full(engine, param: torch.nn.Parameter, values: dict[str, torch.Tensor]) -> None:
    """Write this rank's part of each given key (any of KEYS) from its whole tensor (needs
    ``prime`` first)."""
    if _partitioned(param):
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        for k, v in values.items():
            if k == "param":
                safe_set_full_fp32_param(param, v.to(param.device))
            else:
                safe_set_full_optimizer_state(param, v.to(param.device), k)
        return
    state = engine.optimizer.state[param]
    with torch.no_grad():
        for k, v in values.items():
            (param if k == "param" else state[k]).copy_(v)


def fragment(param: torch.nn.Parameter) -> tuple[int, int] | None:
    """(start, numel): the flat range of the parameter's (tensor-parallel) tensor whose
    optimizer state DeepSpeed keeps on this rank, the only elements of a whole value that
    ``set_full`` copies ((0, 0): none); None when it reads the whole value.

    DeepSpeed's ZeRO-1/2 and bf16 optimizers map each parameter to its fragment of this
    rank's flat partition, and their ``safe_set_full_*`` copy ``value.flatten()`` narrowed to
    ``param._hp_mapping.lp_fragment_address`` (deepspeed/utils/tensor_fragment.py,
    set_full_hp_param; ``_hp_mapping`` is None on a rank holding none of the parameter). That
    address is read here only to know WHICH bytes a resume needs to read from disk; the values
    are still written through DeepSpeed's accessors, never into its flat partitions.

    ZeRO-3's ``safe_set_full_*`` (``set_full_hp_param`` in deepspeed/runtime/zero/stage3.py)
    copies ``value.flatten()`` narrowed at ``partition_numel() * `` the rank in the
    parameter's partition group (``ds_process_group``, else the data-parallel group), as many
    elements as the rank's partition holds of the parameter (the last one may hold fewer)."""
    if hasattr(param, "ds_id"):
        import torch.distributed as dist

        if not param.requires_grad:
            return (0, 0)
        per = int(param.partition_numel())
        start = per * dist.get_rank(group=getattr(param, "ds_process_group", None))
        return (start, max(0, min(per, int(param.ds_numel) - start)))
    if not hasattr(param, "_hp_mapping"):
        return None
    if param._hp_mapping is None:
        return (0, 0)
    address = param._hp_mapping.lp_fragment_address
    return (int(address.start), int(address.numel))


def prime(engine) -> None:
    """Create the optimizer state (zero moments) without moving a weight; see the docstring.
    ZeRO-3 hands the basic optimizer one fp32 sub-group at a time (its param groups are
    empty in between), so each sub-group is stepped by ZeRO-3's own sub-group step."""
    basic, opt = engine.basic_optimizer, engine.optimizer
    z3 = getattr(opt, "fp32_partitioned_groups_flat", None)
    flats = list(z3) if z3 is not None else [p for g in basic.param_groups for p in g["params"]]
    if flats and all(basic.state.get(p) for p in flats):
        return
    if z3 is None and _state_from_probe(basic, flats):
        link(engine)
        return
    with _zero_lr(basic), _zero_grads(flats):
        if z3 is None:
            basic.step()
        else:
            for i in range(len(z3)):
                opt._optimizer_step(i)
    link(engine)


def _state_from_probe(basic, flats: list[torch.Tensor]) -> bool:
    """For torch.optim optimizers: the state one step creates, without stepping the real
    parameters. A copy of the optimizer on a two-element tensor takes that step (zero
    gradient, learning rate 0); each parameter without state gets the same entries, tensors
    of the probe's shape as zeros of the parameter's shape (Adam's moments), the others
    (the step count, set later) copied. A real step would also allocate zero gradients and,
    for Adam, two temporaries of each parameter's size (its denominator): DeepSpeed's flat
    partitions are a few large tensors, so that step doubled the memory the state needs.
    False (nothing done) for other optimizers."""
    import copy
    import inspect

    if not type(basic).__module__.startswith("torch.optim.") or not flats:
        return False
    probe_param = torch.zeros(2, dtype=flats[0].dtype, requires_grad=True)
    accepted = inspect.signature(type(basic).__init__).parameters
    probe = type(basic)([probe_param], **{k: v for k, v in basic.defaults.items() if k in accepted})
    probe_param.grad = torch.zeros_like(probe_param)
    with _zero_lr(probe):
        probe.step()
    template = probe.state[probe_param]
    for p in flats:
        if not basic.state.get(p):
            basic.state[p] = {k: torch.zeros_like(p, dtype=v.dtype) if torch.is_tensor(v) and v.shape == probe_param.shape
                              else copy.deepcopy(v) for k, v in template.items()}
    return True


@contextlib.contextmanager
def _zero_lr(basic):
    saved = [{k: g[k] for k in ("lr", "weight_decay") if k in g} for g in basic.param_groups]
    for g in basic.param_groups:
        g.update(lr=0.0, weight_decay=0.0)
    try:
        yield
    finally:
        for g, old in zip(basic.param_groups, saved):
            g.update(old)


@contextlib.contextmanager
def _zero_grads(tensors: list[torch.Tensor]):
    made = [t for t in tensors if t.grad is None]
    for t in made:
        t.grad = torch.zeros_like(t)
    try:
        yield
    finally:
        for t in made:
            t.grad = None


def get_step(engine) -> int:
    basic = engine.basic_optimizer
    for g in basic.param_groups:
        if "step" in g:
            return int(g["step"])
    for state in basic.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def set_step(engine, step: int) -> None:
    basic = engine.basic_optimizer
    for g in basic.param_groups:
        if "step" in g:
            g["step"] = step
    for state in basic.state.values():
        if "step" not in state:
            continue
        if torch.is_tensor(state["step"]):
            state["step"].fill_(step)
        else:
            state["step"] = step


# Megatron-LM's distributed optimizer keeps, beside its tensors, the inner optimizer's param
# groups (without params, each with the step); megatron-core matches them to its own groups by
# these keys (megatron.core.optimizer.optimizer.param_group_identifier_keys).
GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
SHARDING = "fully_reshardable"


def _plain(value):
    return value if isinstance(value, (bool, int, float, str, type(None))) else (
        tuple(value) if isinstance(value, (tuple, list)) else str(value))


def megatron_common(engine) -> dict:
    """What Megatron-LM's DistributedOptimizer.sharded_state_dict keeps outside its tensors:
    {"optimizer": {"param_groups": [...]}, "param_state_sharding_type": "fully_reshardable"}."""
    step, groups = get_step(engine), []
    for g in engine.basic_optimizer.param_groups:
        group = {k: _plain(v) for k, v in g.items() if k != "params"}
        group.update(wd_mult=float(g.get("wd_mult", 1.0)), lr_mult=float(g.get("lr_mult", 1.0)),
                     is_expert_parallel=bool(g.get("moe", False)), is_decoupled_lr=False, step=step)
        groups.append(group)
    return {"optimizer": {"param_groups": groups}, "param_state_sharding_type": SHARDING}


def saved_step(common: dict) -> int:
    """The step of a checkpoint's optimizer common state (Megatron-LM's param groups; an older
    runtime checkpoint kept {"step": N})."""
    if "step" in common:
        return int(common["step"])
    steps = {int(g["step"]) for g in common["optimizer"]["param_groups"] if "step" in g}
    if len(steps) != 1:
        from .carry_over import CheckpointMismatchError

        raise CheckpointMismatchError(f"the optimizer's param groups hold {len(steps)} different steps ({sorted(steps)})")
    return steps.pop()
