"""The toolkit's training step against a hand-written minimal DeepSpeed loop, side by side.

Both sides train the same megatron-core GPTModel (same initial weights), on the same
samples, with the same DeepSpeed config (the spine's, plus the runtime's CPU AdamW
choice), in one process per rank: steps alternate toolkit / hand-written so both see the
same machine load. The toolkit's step is what `train()` runs per step (data, schedule,
loss reduction, grad norm, metrics line); the hand-written one is the textbook loop
(`loss = engine(batch); engine.backward(loss); engine.step()` per micro-batch).

    deepspeed --num_gpus 2 benchmarks/recipe_overhead.py [--steps 40] [--hidden 256] [--set key=value ...]

Prints the median wall and CPU time per step of each and their ratios (target <= 1.02).
On CPU ranks this measures the toolkit's per-step overhead against a tiny model, its worst
case; CPU time (of rank 0's process) is less disturbed by other work on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from toolkit.plan import make_plan  # noqa: E402
from toolkit.mcore import cpu_compat  # noqa: E402
from toolkit.runtime import trainer  # noqa: E402
from toolkit.runtime.engine import runtime_config  # noqa: E402
from toolkit.runtime.init import init_layout_independent  # noqa: E402
from toolkit.runtime.model import build_model_chunks  # noqa: E402
from toolkit.runtime.recipe import tiny_flavor  # noqa: E402
from toolkit.spec import TrainingSpec, parse_assignment  # noqa: E402


class Minimal(torch.nn.Module):
    """What a user writes around a GPTModel: forward to the mean token loss."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, tokens, labels, position_ids):
        mask = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool), 1)[None, None]
        return self.gpt(input_ids=tokens, position_ids=position_ids, attention_mask=mask, labels=labels).mean()


def hand_written(plan):
    """deepspeed.initialize on the model, as in DeepSpeed's getting-started guide."""
    import deepspeed

    chunks = build_model_chunks(plan)
    if cpu_compat.needed():
        init_layout_independent(chunks, plan.spec.train.seed)
    model = Minimal(chunks[0])
    decay = plan.spec.optimizer.weight_decay  # no weight decay on norms and biases, as the toolkit does
    groups = [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": decay},
              {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=runtime_config(plan))
    return engine


def hand_written_step(engine, dataset, step: int, plan) -> tuple[float, float]:
    b, rank, world = plan.batch, torch.distributed.get_rank(), torch.distributed.get_world_size()
    start, cpu = time.perf_counter(), time.process_time()
    for k in range(b.grad_accum):
        first = step * b.global_ + k * b.micro * world + rank * b.micro
        samples = [dataset[i % len(dataset)] for i in range(first, first + b.micro)]
        batch = {key: torch.stack([s[key] for s in samples]) for key in ("tokens", "labels", "position_ids")}
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
    return time.perf_counter() - start, time.process_time() - cpu


def toolkit_step(sess, step: int, log) -> tuple[float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    m = trainer.run_step(sess, step)
    log.write(json.dumps(m.__dict__) + "\n")
    return time.perf_counter() - start, time.process_time() - cpu


def make_spec(args) -> TrainingSpec:
    """The llama8b recipe's tiny flavour on the ranks present; --hidden widens the model
    (a config.json written next to the run) so compute dominates more of the step."""
    import importlib.util

    mod_spec = importlib.util.spec_from_file_location("llama8b", ROOT / "recipes" / "llama8b.py")
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    spec = tiny_flavor(mod.make_spec(), mod.TINY, int(os.environ.get("WORLD_SIZE", "1")))
    over = dict(parse_assignment(s) for s in args.sets)
    if args.hidden:
        from toolkit.models import hf_config_dict, load_model

        cfg = hf_config_dict(load_model(mod.TINY))
        cfg.update(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_attention_heads=args.hidden // 32,
                   num_key_value_heads=args.hidden // 64)
        path = Path(args.out) / "model" / "config.json"
        if torch.distributed.get_rank() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(cfg))
        torch.distributed.barrier()
        over["model"] = str(path)
    return spec.with_overrides(over) if over else spec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--hidden", type=int, help="hidden size of a wider llama-tiny (heads of 32)")
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "recipe_overhead"), help="scratch folder")
    p.add_argument("--set", dest="sets", action="append", default=[])
    p.add_argument("--local_rank", type=int)
    args = p.parse_args()
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    spec = make_spec(args).with_overrides({"train.steps": args.steps})
    plan = make_plan(spec).require_valid()
    sess = trainer.setup(plan, trainer.RunOptions(out=Path(args.out), data=trainer.BUILTIN, overwrite=True))
    engine = hand_written(plan)
    times: dict[str, list[tuple[float, float]]] = {"toolkit": [], "hand-written": []}
    with open(Path(args.out) / f"metrics{torch.distributed.get_rank()}.jsonl", "w") as log:
        for step in range(args.steps):
            if step % 2 == 0:
                times["toolkit"].append(toolkit_step(sess, step, log))
            times["hand-written"].append(hand_written_step(engine, sess.dataset, step, plan))
            if step % 2 == 1:
                times["toolkit"].append(toolkit_step(sess, step, log))
    if torch.distributed.get_rank() == 0:
        report(plan, args, times)
    return 0


def report(plan, args, times: dict[str, list[tuple[float, float]]]) -> None:
    """Median wall and CPU time per step; the ratios are medians of per-step ratios."""
    kept = {k: v[args.warmup:] for k, v in times.items()}
    pairs = list(zip(kept["toolkit"], kept["hand-written"]))
    ratio = [statistics.median(a[i] / b[i] for a, b in pairs) for i in (0, 1)]
    lay, b = plan.layout, plan.batch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no GPU)"
    print(f"{plan.shape.architecture} {plan.spec.model}: tp={lay.tp} pp={lay.pp} dp={lay.dp} "
          f"ZeRO-{plan.spec.zero.stage} {plan.spec.precision}, micro {b.micro} x accumulation {b.grad_accum}, "
          f"seq {b.seq_len}, {lay.world} ranks on {device}; medians of {len(pairs)} steps")
    for k, v in kept.items():
        wall, cpu = (statistics.median(t[i] for t in v) * 1000 for i in (0, 1))
        print(f"  {k:13s} {wall:8.1f} ms/step wall, {cpu:8.1f} ms/step CPU (rank 0)")
    print(f"  ratio toolkit / hand-written: {ratio[0]:.3f} wall, {ratio[1]:.3f} CPU (target <= 1.02)")

if __name__ == "__main__":
    sys.exit(main())
