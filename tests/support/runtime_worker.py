"""Not a test module: runs several training runs of the real runtime in ONE multi-rank launch
(tests start it with torchrun; one launch saves the ~10 s of imports per run).

    python -m torch.distributed.run --nproc_per_node N tests/support/runtime_worker.py RUNS.json

RUNS.json: a list of runs, each {"name", "recipe", "sets": {dotted: value}, "out", "load",
"exit_interval", "scheduler", "record_samples", "export", "export_peft", "steps", "measure", "routing_spread",
"first_step",
"count_syncs", "dump_optimizer", "expect_error", "plain", "megatron_optimizer", "mtp_reference", "export_reference",
"dropout_probe", "command", "nudge", "dump_grads"}; every run trains with toolkit.runtime.trainer.train exactly as a recipe does
(tiny flavour on the ranks present), or with "first_step" only the runtime's setup and its first step
(trainer.setup, trainer.run_step: no checkpoint, the step's metrics and every rank's gradient norm go to
OUT/worker.json), or with "count_syncs" the setup and "steps" steps, each counted by tests/support/host_syncs.py
(OUT/worker.json: "syncs", one record per step); then rank 0 writes OUT/worker.json with what the tests assert
beyond metrics.jsonl: the engine's optimizer and gradient-accumulation dtype, the memory measurements a run asks
for ("measure": "zero3_build"), how many times megatron's activation checkpointing ran (``recomputed``: calls of
tensor_parallel.checkpoint), for models with an expert bias, how evenly the experts were used at each step
(``routing_spread``), and what --load reported (``resumed``: the line the command line prints).
With "record_samples", each rank writes the dataset indices of the samples each step read
(OUT/samples_rank<R>.json: {step: [index, ...]}, as toolkit.runtime.data.collate was given them).
With "dump_optimizer", the optimizer state right after each checkpoint save and right after a
resume's load goes to OUT/optim/{save,load}_step<N>/ (tests/support/optimizer_dump.py); with "first_step" and
"dump_grads", rank 0 saves the first step's reduced gradients to OUT/grads.pt (ZeRO-0); a run whose
setup raises one of the toolkit's errors writes the message to OUT/error.txt ("expect_error").
Other items: "plain" (a plain DeepSpeed engine, tests/support/plain_deepspeed.py), "megatron_optimizer"
(megatron-core's DistributedOptimizer, tests/support/megatron_optimizer.py), "mtp_reference" (megatron-core's
GPTModel with MTP in one process on a saved checkpoint, tests/support/mtp_reference.py), "export_reference" (a run's
final weights in megatron-core's GPTModel, its logits for the export's, tests/support/export_reference.py), "dropout_probe"
(every rank's seeds and dropout masks, tests/support/dropout_probe.py), "command" (rank 0 runs a
command line, e.g. `toolkit convert run-state` or DeepSpeed's ds_to_universal).
"""
import dataclasses
import gc
import importlib.util
import json
import sys
import threading
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class PeakRSS:
    """Peak resident memory of this process while the block runs (sampled every 2 ms)."""

    def __enter__(self):
        self.start = self.peak = self._rss()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def growth(self) -> int:
        return self.peak - self.start

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.002)

    @staticmethod
    def _rss() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0


def recipe_spec(name: str, world: int, sets: dict):
    from toolkit.runtime.recipe import tiny_flavor

    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return tiny_flavor(mod.make_spec(), mod.TINY, world).with_overrides(sets)


def engine_facts(sess) -> dict:
    from toolkit.runtime.schedule import accumulated_grad

    engine = sess.engine
    model_dtype, accum_dtype = engine.get_data_types()
    param = next(p for c in sess.chunks for p in c.parameters())
    buffer = accumulated_grad(engine, param) if hasattr(param, "_hp_grad") else None
    params = [p for c in sess.chunks for p in c.parameters()]
    # ZeRO++'s hierarchical partitioning (zero.hpz_partition_size N): each rank's 16-bit secondary partition
    secondary = [p.ds_secondary_tensor for p in params if getattr(p, "ds_secondary_tensor", None) is not None]
    hpz = {"hpz_secondary_numel": sum(t.numel() for t in secondary),
           "zero3_numel": sum(getattr(p, "ds_numel", 0) for p in params)} if secondary else {}
    return {**hpz, **parameter_counts(sess), "optimizer": type(engine.optimizer).__name__,
            "model_dtype": str(model_dtype),
            "grad_accum_dtype": str(accum_dtype),
            "zero_grad_accum_dtype": str(getattr(engine.optimizer, "gradient_accumulation_dtype", None)),
            "hp_grad_dtype": str(buffer.dtype) if buffer is not None else None, **bf16_optimizer_numel(engine)}


def bf16_optimizer_numel(engine) -> dict:
    """Elements of DeepSpeed's BF16_Optimizer's fp32 gradient buffer (every parameter's, its
    fp32_groups_gradients_flat) and fp32 master partition: what memory.bf16_states counts."""
    opt = engine.optimizer
    if type(opt).__name__ != "BF16_Optimizer":
        return {}
    return {"bf16_grad_buffer_numel": sum(t.numel() for t in opt.fp32_groups_gradients_flat),
            "bf16_master_numel": sum(t.numel() for t in opt.fp32_groups_flat_partition)}


def parameter_counts(sess) -> dict:
    """This rank's trainable and frozen elements, and the elements of the fp32 states its
    optimizer holds after the run (Adam's exp_avg of its ZeRO partition): what the memory
    estimate's gradient and optimizer terms count."""
    from toolkit.runtime.state import local_shape

    params = [p for c in sess.chunks for p in c.parameters()]
    inner = getattr(sess.engine.optimizer, "optimizer", sess.engine.optimizer)  # ZeRO's basic optimizer
    moments = sum(s["exp_avg"].numel() for s in getattr(inner, "state", {}).values() if "exp_avg" in s)
    return {"trainable_numel": sum(local_shape(p).numel() for p in params if p.requires_grad),
            "frozen_numel": sum(local_shape(p).numel() for p in params if not p.requires_grad),
            "exp_avg_numel": moments}


def fixed_mmap_threshold(size: int = 128 * 1024) -> None:
    """glibc's dynamic mmap threshold would keep freed transients resident; a fixed one (what
    MALLOC_MMAP_THRESHOLD_ sets at start-up) lets RSS show what is live (what ZeRO-3
    partitions), as a GPU allocator's statistics would. Set for the measured run only: every
    large allocation an mmap slows the runs before it."""
    import ctypes

    M_MMAP_THRESHOLD = -3  # glibc malloc.h
    assert ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, size) == 1


def zero3_build(plan) -> dict:
    """Peak memory of building the model under ZeRO-3 against its unpartitioned size, and of
    saving a checkpoint against the rank's share of the training state."""
    from toolkit.mcore.distributed import init_parallel, release_model_parallel
    from toolkit.runtime import state
    from toolkit.runtime.init import init_layout_independent
    from toolkit.runtime.model import build_model_chunks

    init_parallel(plan.layout, plan.spec.train.seed)
    gc.collect()
    with PeakRSS() as build:
        chunks = build_model_chunks(plan)
        init_layout_independent(chunks, plan.spec.train.seed)
    numels = [state.local_shape(p).numel() for c in chunks for p in c.parameters()]
    del chunks
    release_model_parallel()  # the run then sets up its own grid (trainer.setup)
    return {"build_growth": build.growth, "model_bytes": 4 * sum(numels), "largest_bytes": 4 * max(numels)}


def count_syncs(sess, steps: int) -> list[dict]:
    """Per step of the runtime (trainer.run_step), what would make the host wait for a GPU and
    the causal masks allocated (tests/support/host_syncs.py); no checkpoint, no metrics file."""
    from host_syncs import HostSyncs

    from toolkit.runtime import trainer

    counts = []
    for step in range(steps):
        with HostSyncs(sess.plan.batch.seq_len) as c:
            trainer.run_step(sess, step)
        counts.append(c.counts())
    return counts


class DumpOptimizer:
    """Dump the optimizer state after every checkpoint.save and checkpoint.load of the run."""

    def __init__(self, out: Path, active: bool):
        self.out, self.active = out / "optim", active

    def __enter__(self):
        from toolkit.runtime import checkpoint

        self.module, self.real = checkpoint, (checkpoint.save, checkpoint.load)
        if not self.active:
            return self
        from optimizer_dump import dump

        def save(engine, plan, cat, root, state, *args, **kwargs):  # the runtime's arguments, passed through
            folder = self.real[0](engine, plan, cat, root, state, *args, **kwargs)
            dump(engine, cat, self.out / f"save_step{state.step}")
            return folder

        def load(engine, plan, cat, folder, *args, **kwargs):
            position = self.real[1](engine, plan, cat, folder, *args, **kwargs)
            dump(engine, cat, self.out / f"load_step{position.step}")
            return position

        checkpoint.save, checkpoint.load = save, load
        return self

    def __exit__(self, *exc):
        self.module.save, self.module.load = self.real


class RecordSamples:
    """The dataset indices each step of the run hands to data.collate, on this rank."""

    def __init__(self, out: Path, active: bool):
        self.out, self.active, self.steps, self.step = out, active, {}, None

    def __enter__(self):
        from toolkit.runtime import data, trainer

        self.modules = (trainer, data)
        self.real = (trainer.micro_batches, data.collate)
        if not self.active:
            return self

        def micro_batches(sess, step, *args, **kwargs):  # the runtime's arguments, passed through
            self.step = step + 1
            return self.real[0](sess, step, *args, **kwargs)

        def collate(dataset, ids, *args, **kwargs):
            self.steps.setdefault(self.step, []).extend(int(i) for i in ids)
            return self.real[1](dataset, ids, *args, **kwargs)

        trainer.micro_batches, data.collate = micro_batches, collate
        return self

    def __exit__(self, *exc):
        self.modules[0].micro_batches, self.modules[1].collate = self.real
        if self.active:
            import torch.distributed as dist

            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / f"samples_rank{dist.get_rank()}.json").write_text(json.dumps(self.steps) + "\n")


class CountCheckpoints:
    """Counts megatron's activation-checkpoint calls (selective: core attention; full: layers)."""

    def __enter__(self):
        from megatron.core import tensor_parallel

        self.module, self.real, self.calls = tensor_parallel, tensor_parallel.checkpoint, 0

        def counted(*args, **kwargs):
            self.calls += 1
            return self.real(*args, **kwargs)

        tensor_parallel.checkpoint = counted
        return self

    def __exit__(self, *exc):
        self.module.checkpoint = self.real


class RoutingSpread:
    """Per step, how unevenly the routed experts receive tokens: the mean over MoE layers of
    std / mean of the step's per-expert token counts (summed over all ranks), read from
    megatron's routers (``local_tokens_per_expert``) just before the runtime updates the
    expert bias from them. Only for runs that ask ("routing_spread": true) at data parallel
    only: the all-reduce needs the same MoE layers on every rank."""

    def __init__(self, enabled: bool):
        self.steps: list[float] = []
        self.enabled = enabled

    def __enter__(self):
        from toolkit.runtime import schedule

        if not self.enabled:
            self.module = None
            return self

        self.module, self.real = schedule, schedule.update_expert_bias

        def measured(chunks):
            self.record(chunks)
            return self.real(chunks)

        schedule.update_expert_bias = measured
        return self

    def __exit__(self, *exc):
        if self.module is not None:
            self.module.update_expert_bias = self.real

    def record(self, chunks) -> None:
        import torch
        import torch.distributed as dist

        counts = [m.local_tokens_per_expert.detach().clone().float() for c in chunks for m in c.modules()
                  if getattr(m, "local_tokens_per_expert", None) is not None]
        if not counts:
            return
        t = torch.stack(counts)
        dist.all_reduce(t)
        self.steps.append(float((t.std(dim=1) / t.mean(dim=1)).mean()))


class Nudge:
    """With "nudge": every initial weight moved by one float32 ulp, up or down at random (the same
    on every rank, so data-parallel replicas stay equal): the run is the reference run with
    float32 round-off injected once, and how far it parts from the reference over its steps
    is how far round-off alone carries these steps on this machine (tests/recipes/test_recipes.py: same_curve).
    A run that starts from weights (--load: a converted model or a checkpoint) is nudged after
    they are loaded, before DeepSpeed copies them into its fp32 masters (trainer.setup's order)."""

    def __init__(self, enabled: bool):
        self.enabled, self.chunks, self.seed = enabled, None, None

    def __enter__(self):
        from toolkit.runtime import checkpoint, trainer

        self.real = {trainer: ("init_layout_independent", trainer.init_layout_independent),
                     checkpoint: ("load_weights", checkpoint.load_weights)}
        if not self.enabled:
            return self
        real_init, real_load = trainer.init_layout_independent, checkpoint.load_weights

        def nudged(chunks, seed, *args, **kwargs):  # the runtime's arguments, passed through
            real_init(chunks, seed, *args, **kwargs)
            self.chunks, self.seed = chunks, seed
            nudge(chunks, seed)

        def loaded(*args, **kwargs):  # the runtime's arguments, passed through
            real_load(*args, **kwargs)
            nudge(self.chunks, self.seed)

        trainer.init_layout_independent, checkpoint.load_weights = nudged, loaded
        return self

    def __exit__(self, *exc):
        for module, (name, real) in self.real.items():
            setattr(module, name, real)


def nudge(chunks, seed: int) -> None:
    """Every weight one float32 ulp up or down, drawn from `seed` (the same on every rank)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                up = torch.randint(0, 2, p.shape, generator=g, dtype=torch.bool)
                p.copy_(torch.nextafter(p, torch.where(up, torch.inf, -torch.inf).to(p.dtype)))


def dump_grads_at_boundary(sess, path: Path) -> None:
    """Rank 0 saves every parameter's gradient (by its catalog name) when DeepSpeed is about to
    step at the accumulation boundary: dp-reduced, before clipping and the update (ZeRO-0, where
    they are the parameters' .grad)."""
    import torch
    import torch.distributed as dist

    engine, real = sess.engine, sess.engine.step
    names = {id(p): n for c in sess.chunks for n, p in c.named_parameters()}

    def step(*args, **kwargs):
        if engine.is_gradient_accumulation_boundary() and dist.get_rank() == 0 and not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({names[id(p)]: p.grad.detach().clone() for c in sess.chunks for p in c.parameters()
                        if p.grad is not None}, path)
        return real(*args, **kwargs)

    engine.step = step


def run_command(item: dict) -> dict:
    """Rank 0 runs item["command"] (argv; "{python}" is this interpreter) while the others wait;
    its output goes to OUT/command.log and a failure stops every rank."""
    import subprocess

    import torch.distributed as dist

    from toolkit.mcore.distributed import init_process_group

    init_process_group()
    ok = [True]
    if dist.get_rank() == 0:
        argv = [sys.executable if a == "{python}" else a for a in item["command"]]
        r = subprocess.run(argv, capture_output=True, text=True)
        Path(item["out"]).mkdir(parents=True, exist_ok=True)
        (Path(item["out"]) / "command.log").write_text(f"{argv}\nexit {r.returncode}\n{r.stdout}\n{r.stderr}")
        ok[0] = r.returncode == 0
    dist.broadcast_object_list(ok, src=0)
    assert ok[0], f"{item['command']} failed: see {item['out']}/command.log"
    return {}


def run(item: dict, world: int) -> dict:
    import torch.distributed as dist

    from toolkit.plan import make_plan
    from toolkit.runtime import trainer
    from toolkit.runtime.export import export_hf

    if item.get("command"):
        return run_command(item)
    if item.get("export_reference"):
        from export_reference import reference_logits

        return reference_logits(item, world)
    plan = make_plan(recipe_spec(item["recipe"], world, {"train.steps": item.get("steps", 3), **item.get("sets", {})}))
    plan.require_valid()
    if item.get("plain") or item.get("megatron_optimizer"):
        return other_engine(plan, item)
    if item.get("mtp_reference"):
        return mtp_reference(plan, item)
    if item.get("dropout_probe"):
        from dropout_probe import probe

        return probe(plan, item)
    facts: dict = {}
    if item.get("measure") == "zero3_build":
        fixed_mmap_threshold()
        facts.update(zero3_build(plan))
    opts = trainer.RunOptions(out=Path(item["out"]), data=item.get("data", "builtin"), load=item.get("load"),
                              overwrite=True, exit_interval=item.get("exit_interval"), scheduler=item.get("scheduler"))
    with CountCheckpoints() as counter, RoutingSpread(item.get("routing_spread", False)) as spread, \
            DumpOptimizer(Path(item["out"]), item.get("dump_optimizer", False)), Nudge(item.get("nudge", False)), \
            RecordSamples(Path(item["out"]), item.get("record_samples", False)):
        if item.get("expect_error"):
            return expect_error(plan, opts)
        if item.get("first_step"):
            sess = trainer.setup(plan, opts)
            if item.get("dump_grads"):
                dump_grads_at_boundary(sess, Path(item["out"]) / "grads.pt")
            facts["first_step"] = dataclasses.asdict(trainer.run_step(sess, 0))
            facts["grad_norm_by_rank"] = [None] * dist.get_world_size()  # what each rank clipped with
            dist.all_gather_object(facts["grad_norm_by_rank"], facts["first_step"]["grad_norm"])
        elif item.get("count_syncs"):
            sess = trainer.setup(plan, opts)
            facts["syncs"] = count_syncs(sess, item.get("steps", 3))
        else:
            sess = trainer.train(plan, opts)
    facts.update(engine_facts(sess), recomputed=counter.calls, routing_spread=spread.steps,
                 resumed=sess.resumed.line() if sess.resumed else None)
    if item.get("measure") == "zero3_build":
        gc.collect()
        with PeakRSS() as save:
            trainer.save_checkpoint(sess)
        facts["save_growth"] = save.growth
    if item.get("export"):
        export_hf(sess, item["export"], overwrite=True)
    if item.get("export_peft"):
        from toolkit.runtime.export import export_peft

        export_peft(sess, item["export_peft"], overwrite=True)
    # trainer.close must give the run's model back (weakly watched through one parameter)
    probe = weakref.ref(next(p for c in sess.chunks for p in c.parameters()))
    trainer.close(sess)
    del sess
    gc.collect()
    gc.collect()  # DeepSpeed's bf16 optimizer: its parameters go at the second collection
    facts["model_freed"] = probe() is None
    if dist.get_rank() == 0:
        Path(item["out"]).mkdir(parents=True, exist_ok=True)
        (Path(item["out"]) / "worker.json").write_text(json.dumps(facts) + "\n")
    return facts


def other_engine(plan, item: dict) -> dict:
    """A plain DeepSpeed run (tests/support/plain_deepspeed.py) or megatron-core's DistributedOptimizer
    (tests/support/megatron_optimizer.py) on the same model, data and schedule."""
    from toolkit.runtime import trainer

    out = Path(item["out"])
    if item.get("plain"):
        from plain_deepspeed import run_plain

        run_plain(plan, item, trainer.RunOptions(out=out, data=item.get("data", "builtin"), overwrite=True))
    else:
        from megatron_optimizer import run_megatron_optimizer

        run_megatron_optimizer(plan, item, out)
    gc.collect()
    return {}


def mtp_reference(plan, item: dict) -> dict:
    """megatron-core's GPTModel with MTP in one process (tests/support/mtp_reference.py); every rank
    computes it, rank 0 writes OUT/worker.json."""
    import torch.distributed as dist
    from mtp_reference import run_reference

    facts = run_reference(plan, item)
    if dist.get_rank() == 0:
        Path(item["out"]).mkdir(parents=True, exist_ok=True)
        (Path(item["out"]) / "worker.json").write_text(json.dumps(facts) + "\n")
    gc.collect()
    return facts


def expect_error(plan, opts) -> dict:
    """Set up a run that must fail with one of the toolkit's errors; rank 0 records its message."""
    import torch.distributed as dist

    from toolkit.errors import ToolkitError
    from toolkit.runtime import trainer

    try:
        trainer.setup(plan, opts)
        message = "no error"
    except ToolkitError as e:
        message = f"{type(e).__name__}: {e}"
    if dist.get_rank() == 0:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / "error.txt").write_text(message + "\n")
    dist.barrier()
    return {}


def reuse_process_groups() -> None:
    """Megatron's grid is made anew for every run, and each 2-rank grid brings some 50
    gloo groups, a thread each. Runs that end through trainer.close give theirs back; the
    reference runs this worker builds itself (plain DeepSpeed engines, megatron's own
    optimizer, the MTP and expert references) keep them. Measured over the whole suite with
    this function removed (2026-11-25, once trainer.close freed ZeRO-3 runs too): the
    trainer runs stayed at 12-15 threads, the resume launch grew 12 -> 327 threads over its
    reference runs, the DeepSeek one 13 -> 121, the recipes one 12 -> 120; the launches' runs
    took 1630 s in all against 1283 s in the suite run just before, with it (the machine was
    busier: load average up to 11).
    Every grid of N ranks is made of the same few rank sets, so torch.distributed.new_group
    hands back the group it made before for the same ranks and backend (every rank asks in
    the same order, so every rank gets the same answer). A destroyed group (trainer.close
    destroys megatron's) is made anew, on every rank when any rank finds it destroyed
    (new_group is collective; non-members cannot tell)."""
    import torch.distributed as dist

    made, new_group = {}, dist.new_group

    def alive(group) -> bool:
        try:
            dist.get_process_group_ranks(group)
            return True
        except KeyError:
            return False

    def cached(ranks=None, *args, **kwargs):
        import torch

        key = (tuple(sorted(ranks)) if ranks is not None else None, kwargs.get("backend"))
        # a non-member holds a placeholder, not the destroyed group: agree on "made anew"
        stale = torch.tensor([int(key not in made or not alive(made[key]))])
        dist.all_reduce(stale, op=dist.ReduceOp.MAX)
        if stale.item():
            made[key] = new_group(ranks, *args, **kwargs)
        return made[key]

    dist.new_group = cached


def main(runs_file: str) -> None:
    import os

    from toolkit.quiet import quiet_run

    quiet_run(cpu=True, transformer_engine=False)  # CPU ranks, megatron's local layers
    from toolkit.startup import imports_uncollected

    # the libraries' import-time objects (hundreds of thousands) are never garbage: imported without
    # collections and then frozen, out of every collection (the gc.collect after each run takes
    # milliseconds instead of half a second), as the command line imports them (toolkit.startup)
    with imports_uncollected():
        from toolkit.mcore.cpu_compat import eager_fusers

        eager_fusers()  # as the command line does before megatron is imported
        reuse_process_groups()
        import megatron.core.models.gpt  # noqa: F401

        import toolkit.runtime.trainer  # noqa: F401
    world = int(os.environ["WORLD_SIZE"])
    timings = Path(runs_file).with_suffix(".seconds.jsonl")  # rank 0: each run's wall time
    for item in json.loads(Path(runs_file).read_text()):
        start = time.perf_counter()
        run(item, world)
        if os.environ.get("RANK") == "0":
            with timings.open("a") as f:
                f.write(json.dumps({"name": item.get("name"), "seconds": round(time.perf_counter() - start, 2),
                                    "threads": len(os.listdir("/proc/self/task"))}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
