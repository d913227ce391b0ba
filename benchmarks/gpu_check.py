"""The first run on a machine with a GPU: does the CUDA path train, and do the plan's estimates hold?

    python benchmarks/gpu_check.py [--work DIR] [--layers LAYERS] [--steps 6]

Needs one CUDA GPU with TransformerEngine (and, as on any GPU machine, deepspeed and megatron-core);
about 8 minutes on one H100. On a machine without CUDA it says so and exits 0: nothing here has
ever run on a GPU (no GPU is lent to this project), so this is the script to run first on one.

Each case is the runtime's own training run (toolkit.runtime.trainer.train, what `deepspeed
recipes/...` runs on every rank) in a process of its own (fresh CUDA memory statistics), on one
GPU: megatron-core's TransformerEngine layer spec with flash attention and fused kernels,
DeepSpeed's engine with its fused Adam, the tiny built-in corpus. Cases: a Llama-3-8B cut to
--layers layers at its real widths (hidden 4096, 32 heads / 8 KV, ffn 14336, vocab 128256) at
recompute none / selective / full, micro-batch 1 / 2, sequence 4096 / 8192, bf16 and fp16 (loss
scaling); an MoE (Qwen3-30B-A3B cut to half as many layers at its real widths: 128 experts,
top-8, the recipe's alltoall dispatcher and grouped GEMM); and a save at step 3 resumed in a new process, whose steps 4.. must equal the
uninterrupted run's bit for bit.

The table compares, per case, `torch.cuda.max_memory_allocated()` with the plan's per-GPU estimate
(model states + activations at the peak; the estimate's buffers, which the allocator does not see,
left out) and the median step time after the first two steps with the plan's step time. What to
do with it: a memory ratio outside 0.90-1.10 or a time ratio outside 0.75-1.25 is a finding for
toolkit/estimate (memory.py, activations.py, time.py); a case that fails is a runtime bug on the CUDA
path (its log is in WORK/CASE/log.txt).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 1024**3
MEMORY_OK, TIME_OK = (0.90, 1.10), (0.75, 1.25)
LLAMA = {  # case -> spec overrides of the cut Llama-3-8B (recipes/llama8b.py, one GPU)
    "bf16 none m1 s4k": {"recompute": "none", "batch.micro": 1, "batch.seq_len": 4096},
    "bf16 selective m2 s4k": {"recompute": "selective", "batch.micro": 2, "batch.seq_len": 4096},
    "bf16 none m2 s4k": {"recompute": "none", "batch.micro": 2, "batch.seq_len": 4096},
    "bf16 selective m1 s8k": {"recompute": "selective", "batch.micro": 1, "batch.seq_len": 8192},
    "bf16 full m2 s8k": {"recompute": "full", "batch.micro": 2, "batch.seq_len": 8192},
    "fp16 selective m1 s4k": {"recompute": "selective", "batch.micro": 1, "batch.seq_len": 4096,
                              "precision": "fp16"},
}
RESUMED = "bf16 none m1 s4k"  # saved at step 3 and resumed in a new process
MOE = "moe qwen3-30b-a3b"  # cut to half the layers, real widths: 128 experts top-8, grouped GEMM, alltoall


def gpu_name() -> str:
    """The registry GPU nearest to this device (by generation, then memory)."""
    import torch

    from toolkit.hardware import GPUS

    props = torch.cuda.get_device_properties(0)
    arch = {8: "ampere", 9: "hopper"}.get(props.major, "hopper")
    gib = props.total_memory / GiB
    same = [g for g in GPUS.values() if g.arch == arch and g.name != "cpu"] or list(GPUS.values())
    return min(same, key=lambda g: abs(g.memory_gib - gib)).name


def cut_model(work: Path, name: str, layers: int) -> str:
    """A registry model's config.json with `layers` layers (real widths), in WORK/NAME-cut."""
    from toolkit.models import named_models

    folder = Path(work) / f"{name}-cut{layers}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**named_models()[name]["config"], "num_hidden_layers": layers}))
    return str(folder)


def case_spec(name: str, work: Path, layers: int, steps: int, gpu: str) -> dict:
    """The spec of one case, as a dict: the recipe's spec on one GPU with a cut model."""
    sys.path.insert(0, str(ROOT / "recipes"))
    one_gpu = {"cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": gpu}, "parallel": {}, "train.steps": steps,
               "train.log_interval": 1, "optimizer.warmup_steps": 0}
    if name == MOE:
        import qwen3_30b_a3b

        over = {**one_gpu, "model": cut_model(work, "qwen3-30b-a3b", max(1, layers // 2)), "train.save_interval": 10**6,
                "batch.micro": 1, "batch.global": 1}
        return qwen3_30b_a3b.make_spec().with_overrides(over).to_dict()
    import llama8b

    over = {**one_gpu, "model": cut_model(work, "llama3-8b", layers),
            "train.save_interval": 3 if name == RESUMED else 10**6, **LLAMA[name]}
    over["batch.global"] = over["batch.micro"]
    return llama8b.make_spec().with_overrides(over).to_dict()


def choose_layers(work: Path, steps: int, gpu: str, most: int = 4) -> int:
    """The most layers (up to `most`) at which the plan says every case fits this GPU."""
    from toolkit.plan import make_plan
    from toolkit.spec import TrainingSpec

    for layers in range(most, 0, -1):
        plans = [make_plan(TrainingSpec.from_dict(case_spec(n, work, layers, steps, gpu))) for n in [*LLAMA, MOE]]
        if all(p.valid for p in plans):
            return layers
    raise SystemExit(f"gpu_check: not even one layer of every case fits a {gpu} by the plan: {plans[0].errors[0]}")


def child(spec_path: Path, out: Path, load: str | None) -> int:
    """One case in this process: train, then write OUT/result.json."""
    import torch

    from toolkit import quiet
    from toolkit.kernels import spec_kernels
    from toolkit.mcore.rendezvous import single_process_env
    from toolkit.plan import make_plan
    from toolkit.runtime import trainer
    from toolkit.spec import TrainingSpec

    single_process_env("")
    plan = make_plan(TrainingSpec.from_yaml(spec_path)).require_valid()
    quiet.quiet_run(cpu=False, transformer_engine=spec_kernels(plan.spec).transformer_engine)
    torch.cuda.reset_peak_memory_stats()
    opts = trainer.RunOptions(out=out, data=trainer.BUILTIN, load=load, overwrite=load is None)
    sess = trainer.train(plan, opts)
    peak = torch.cuda.max_memory_allocated()
    trainer.close(sess)
    w = plan.memory.worst
    (out / "result.json").write_text(json.dumps({
        "measured_gib": peak / GiB, "estimated_gib": (w.total - w.buffers) / GiB,
        "estimated_s": plan.time.step_time_s, "layout": f"ZeRO-{plan.spec.zero.stage}"}))
    return 0


def run_case(name: str, args, load: str | None = None) -> dict:
    import yaml

    out = Path(args.work) / name.replace(" ", "_") / ("resumed" if load else "run")
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.yaml"
    spec.write_text(yaml.safe_dump(case_spec(name, args.work, args.layers, args.steps, gpu_name()), sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    start = time.time()
    cmd = [sys.executable, __file__, "--child", str(spec), "--out", str(out)] + (["--load", load] if load else [])
    with (out / "log.txt").open("w") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    result = {"name": name + (" (resumed)" if load else ""), "ok": code == 0, "wall_s": time.time() - start,
              "log": str(out / "log.txt")}
    if code == 0:
        result.update(json.loads((out / "result.json").read_text()))
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        result["steps"] = steps
        result["measured_s"] = statistics.median(m["step_time_s"] for m in steps[2:] or steps)
    return result


def verdict(lo_hi: tuple[float, float], ratio: float) -> str:
    return "ok" if lo_hi[0] <= ratio <= lo_hi[1] else "CHECK"


def table(results: list[dict]) -> str:
    head = (f"{'case':28} {'layout':10} {'est GiB':>8} {'meas GiB':>9} {'ratio':>6} {'':5} {'est s':>7} "
            f"{'meas s':>7} {'ratio':>6} {'':5} loss first -> last")
    lines = [head, "-" * len(head)]
    for r in results:
        if not r["ok"]:
            lines.append(f"{r['name']:28} FAILED after {r['wall_s']:.0f} s: see {r['log']}")
            continue
        m, t = r["measured_gib"] / r["estimated_gib"], r["measured_s"] / r["estimated_s"]
        loss = f"{r['steps'][0]['loss']:.4f} -> {r['steps'][-1]['loss']:.4f}"
        lines.append(f"{r['name']:28} {r['layout']:10} {r['estimated_gib']:8.2f} {r['measured_gib']:9.2f} {m:6.2f} "
                     f"{verdict(MEMORY_OK, m):5} {r['estimated_s']:7.3f} {r['measured_s']:7.3f} {t:6.2f} "
                     f"{verdict(TIME_OK, t):5} {loss}")
    return "\n".join(lines)


def resumed_equal(whole: dict, resumed: dict) -> str:
    if not (whole["ok"] and resumed["ok"]):
        return "checkpoint: not compared (a run failed)"
    later = {m["step"]: m["loss"] for m in whole["steps"]}
    same = all(m["loss"] == later[m["step"]] for m in resumed["steps"])
    return (f"checkpoint: saved at step 3, resumed in a new process: steps "
            f"{resumed['steps'][0]['step']}..{resumed['steps'][-1]['step']} "
            + ("equal the uninterrupted run's bit for bit" if same else "DIFFER from the uninterrupted run's"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="build/gpu_check", help="run folders and logs")
    p.add_argument("--layers", type=int, help="layers of the cut Llama-3-8B (default: the most, up to 4, at "
                                              "which the plan says every case fits this GPU)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--load", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child, args.out, args.load)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine; nothing to check (run it on a machine with one GPU)")
        return 0
    args.layers = args.layers or choose_layers(Path(args.work), args.steps, gpu_name())
    print(f"gpu_check on {torch.cuda.get_device_name(0)} (registry: {gpu_name()}), torch {torch.__version__}, "
          f"Llama-3-8B cut to {args.layers} layers", flush=True)
    results = []
    for name in [*LLAMA, MOE]:
        results.append(run_case(name, args))
        print(f"  {results[-1]['name']}: {'ok' if results[-1]['ok'] else 'FAILED'} "
              f"({results[-1]['wall_s']:.0f} s)", flush=True)
    whole = next(r for r in results if r["name"] == RESUMED)
    ckpt = Path(args.work) / RESUMED.replace(" ", "_") / "run" / "checkpoints" / "global_step3"
    resumed = run_case(RESUMED, args, load=str(ckpt))
    results.append(resumed)
    print("\n" + table(results))
    print(resumed_equal(whole, resumed))
    print(f"memory: measured max_memory_allocated / the plan's estimate without buffers, ok in {MEMORY_OK}; "
          f"time: median step after two / the plan's step time, ok in {TIME_OK}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
