"""Not a test module: runs several training runs of the real runtime in ONE multi-rank launch
(tests start it with torchrun; one launch saves the ~10 s of imports per run).

    python -m torch.distributed.run --nproc_per_node N tests/runtime_worker.py RUNS.json

RUNS.json: a list of runs, each {"name", "recipe", "sets": {dotted: value}, "out", "load",
"export", "steps", "measure"}; every run trains with toolkit.runtime.trainer.train exactly as
a recipe does (tiny flavour on the ranks present), then rank 0 writes OUT/worker.json with what
the tests assert beyond metrics.jsonl: the engine's optimizer and gradient-accumulation dtype,
and the memory measurements a run asks for ("measure": "zero3_build").
"""
import gc
import importlib.util
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    return {"optimizer": type(engine.optimizer).__name__, "model_dtype": str(model_dtype),
            "grad_accum_dtype": str(accum_dtype),
            "zero_grad_accum_dtype": str(getattr(engine.optimizer, "gradient_accumulation_dtype", None)),
            "hp_grad_dtype": str(buffer.dtype) if buffer is not None else None}


def zero3_build(plan) -> dict:
    """Peak memory of building the model under ZeRO-3 against its unpartitioned size, and of
    saving a checkpoint against the rank's share of the training state."""
    from toolkit.runtime import state
    from toolkit.runtime.distributed import Grid, init_parallel
    from toolkit.runtime.init import init_layout_independent
    from toolkit.runtime.model import build_model_chunks

    init_parallel(Grid.of(plan.layout), plan.spec.train.seed)
    gc.collect()
    with PeakRSS() as build:
        chunks = build_model_chunks(plan)
        init_layout_independent(chunks, plan.spec.train.seed)
    numels = [state.local_shape(p).numel() for c in chunks for p in c.parameters()]
    return {"build_growth": build.growth, "model_bytes": 4 * sum(numels), "largest_bytes": 4 * max(numels)}


def run(item: dict, world: int) -> dict:
    import torch.distributed as dist

    from toolkit.plan import make_plan
    from toolkit.runtime import trainer
    from toolkit.runtime.export import export_hf

    plan = make_plan(recipe_spec(item["recipe"], world, {"train.steps": item.get("steps", 3), **item.get("sets", {})}))
    plan.require_valid()
    facts: dict = {}
    if item.get("measure") == "zero3_build":
        facts.update(zero3_build(plan))
    opts = trainer.RunOptions(out=Path(item["out"]), data=item.get("data", "builtin"), load=item.get("load"),
                              overwrite=True)
    sess = trainer.train(plan, opts)
    facts.update(engine_facts(sess))
    if item.get("measure") == "zero3_build":
        gc.collect()
        with PeakRSS() as save:
            trainer.save_checkpoint(sess)
        facts["save_growth"] = save.growth
    if item.get("export"):
        export_hf(sess, item["export"], overwrite=True)
    if dist.get_rank() == 0:
        (Path(item["out"]) / "worker.json").write_text(json.dumps(facts) + "\n")
    del sess
    gc.collect()
    return facts


def main(runs_file: str) -> None:
    import os

    from toolkit.runtime.train import quiet_libraries

    quiet_libraries()
    world = int(os.environ["WORLD_SIZE"])
    for item in json.loads(Path(runs_file).read_text()):
        run(item, world)


if __name__ == "__main__":
    main(sys.argv[1])
