"""Not a test module: a plain DeepSpeed run, as a DeepSpeed user writes it, for the universal
checkpoint checks (run by tests/support/runtime_worker.py items with "plain").

The module handed to ``deepspeed.initialize`` is megatron-core's GPTModel itself (tp = pp = 1,
so its parameter names are the global names the universal checkpoint uses), with no mpu at
tp = 1 (DeepSpeed's data parallel is the world); the loop is the textbook one
(``engine(batch)``, ``engine.backward(loss)``, ``engine.step()`` per micro-batch) on the
runtime's samples, learning-rate schedule (megatron-core's OptimizerParamScheduler as the
client scheduler) and DeepSpeed config, so its loss curve is the runtime's. Checkpoints are
DeepSpeed's own: ``engine.save_checkpoint`` and ``engine.load_checkpoint`` with
``"checkpoint": {"load_universal": true}``. megatron-core's linear layers put
``_extra_state: None`` in their state_dict, which DeepSpeed's ds_to_universal (0.19.8) cannot
convert (``None.float()``): the module drops those entries from its state_dict, as a DeepSpeed
user of megatron-core modules has to.

With "scheduler": "deepspeed" the engine schedules the learning rate with DeepSpeed's own
scheduler instead, the ``scheduler`` section of the ds_config.json `toolkit config` writes.

Item fields: "plain": {"tp": 1|2, "save_at": N (DeepSpeed checkpoint into OUT/ds),
"load_universal": ROOT, "scheduler": "deepspeed"}, "steps": last step, "out"; metrics.jsonl
gets a line per step (its loss and the learning rate the step ran with); after a load,
OUT/scheduler_after_load.json holds the engine's scheduler state (DeepSpeed's scheduler only).
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist


def _engine(plan, universal: bool, deepspeed_scheduler: bool):
    import deepspeed

    from toolkit.emit.deepspeed import deepspeed_config
    from toolkit.runtime.engine import lr_scheduler, param_groups, runtime_config
    from toolkit.runtime.init import init_layout_independent
    from toolkit.runtime.model import build_model_chunks
    from toolkit.runtime.mpu import MegatronMPU

    gpt = build_model_chunks(plan)[0]
    init_layout_independent([gpt], plan.spec.train.seed)
    gpt.register_state_dict_post_hook(_drop_empty_extra_state)
    cfg = runtime_config(plan)
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    if deepspeed_scheduler:
        cfg["scheduler"] = deepspeed_config(plan)["scheduler"]
    mpu = MegatronMPU() if plan.layout.tp > 1 else None
    engine, *_ = deepspeed.initialize(model=gpt, model_parameters=param_groups(gpt, plan.spec.optimizer.weight_decay,
                                                                               False),
                                      lr_scheduler=None if deepspeed_scheduler else lr_scheduler(plan), config=cfg,
                                      mpu=mpu)
    return engine, gpt


def _drop_empty_extra_state(module, state_dict, prefix, local_metadata) -> None:
    for k in [k for k, v in state_dict.items() if k.endswith("._extra_state") and v is None]:
        del state_dict[k]


def _step(engine, dataset, plan, step: int) -> float:
    from megatron.core import parallel_state as ps

    from toolkit.mcore import cpu_compat
    from toolkit.runtime import data

    b = plan.batch
    ids = data.sample_ids(step * b.global_, b.micro, b.global_, ps.get_data_parallel_world_size(),
                          ps.get_data_parallel_rank())
    losses = []
    for mb in (data.collate(dataset, i, engine.device) for i in ids):
        token_losses = engine(input_ids=mb["tokens"], position_ids=mb["position_ids"],
                              attention_mask=cpu_compat.causal_mask(mb["tokens"].shape[1]), labels=mb["labels"])
        loss = (token_losses * mb["loss_mask"]).sum() / mb["loss_mask"].sum()
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    mean = torch.stack(losses).double().mean().reshape(1)
    dist.all_reduce(mean)
    return float(mean) / dist.get_world_size(group=ps.get_data_parallel_group()) / ps.get_tensor_model_parallel_world_size()


def run_plain(plan, item: dict, opts) -> None:
    from optimizer_dump import dump

    from toolkit.mcore.distributed import init_parallel
    from toolkit.runtime import state, trainer

    p = item["plain"]
    init_parallel(plan.layout, plan.spec.train.seed)
    deepspeed_scheduler = p.get("scheduler") == "deepspeed"
    engine, gpt = _engine(plan, "load_universal" in p, deepspeed_scheduler)
    cat = state.catalog(plan, [gpt])
    start = 0
    if "load_universal" in p:
        engine.load_checkpoint(p["load_universal"])
        start = engine.global_steps
        dump(engine, cat, opts.out / "optim" / f"load_step{start}")
        if deepspeed_scheduler and dist.get_rank() == 0:
            (opts.out / "scheduler_after_load.json").write_text(json.dumps(engine.lr_scheduler.state_dict()))
    dataset = trainer.open_dataset(plan, opts, trainer.dataset_prefix(plan, opts))
    lines = []
    for step in range(start, item["steps"]):
        lr = engine.get_lr()[0]  # what this step's optimizer update uses
        lines.append({"step": step + 1, "loss": _step(engine, dataset, plan, step), "lr": lr})
        if step + 1 == p.get("save_at"):
            engine.save_checkpoint(str(opts.out / "ds"), tag=f"global_step{step + 1}")
            dump(engine, cat, opts.out / "optim" / f"save_step{step + 1}")
    if dist.get_rank() == 0:
        (opts.out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    dist.barrier()

