"""Memory of LoRA against full fine-tuning of the same model: the plan's estimate beside the
measured CPU peak, side by side.

    PYTHONPATH=. python benchmarks/lora_memory.py [--hidden 512] [--steps 3] [--rank 8] [--precision bf16]

Each method runs in its own single-rank process (torchrun, fp32 unless --precision, ZeRO-1: the llama8b recipe's
tiny flavour, widened to --hidden with benchmarks/recipe_overhead.py's config so the model
states stand out of the libraries' own memory). Measured over the run's setup and its steps:
the growth of anonymous memory (RssAnon, sampled every ms: benchmarks/memory.py) over the
run's setup and over its steps, from before the setup, and,
exactly, the bytes of the tensors the engine holds after the steps (the modules' weights, ZeRO's
fp32 partition, Adam's moments);
estimated: the plan's stage 0 (weights + gradients + optimizer, and activations), without the
GPU allowance (estimate.buffer_gib).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
MiB = 1024**2


def tensor_bytes(sess) -> dict[str, float]:
    """What the engine holds, counted from its tensors (MiB): the modules' weights, the fp32
    partition ZeRO keeps beside them (a copy, also of fp32 weights) and Adam's moments."""
    params = [p for c in sess.chunks for p in c.parameters()]
    opt = sess.engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    moments = sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values()
                  if hasattr(t, "numel") and t.dim() > 0)
    flat = getattr(opt, "single_partition_of_fp32_groups", None) or getattr(opt, "fp32_groups_flat_partition", [])
    masters = sum(g.numel() * g.element_size() for g in flat)  # ZeRO-1/2's, or DeepSpeed's bf16 optimizer's
    return {"weights": sum(p.numel() * p.element_size() for p in params) / MiB, "masters": masters / MiB,
            "moments": moments / MiB, "trainable": sum(p.numel() for p in params if p.requires_grad),
            "frozen": sum(p.numel() for p in params if not p.requires_grad)}


def worker(method: str, args) -> None:
    """One rank: setup + steps under PeakMemory; OUT/METHOD.json."""
    from memory import PeakMemory
    from recipe_overhead import make_spec

    from toolkit.mcore.distributed import init_process_group
    from toolkit.plan import make_plan
    from toolkit.runtime import trainer

    init_process_group()
    spec_args = argparse.Namespace(sets=[f"finetune.method={method}", f"finetune.lora.rank={args.rank}",
                                         "zero.stage=1", "recompute=none", f"train.steps={args.steps}",
                                         f"precision={args.precision}"],
                                   hidden=args.hidden, out=args.out)
    plan = make_plan(make_spec(spec_args)).require_valid()
    opts = trainer.RunOptions(out=Path(args.out) / method, data=trainer.BUILTIN, overwrite=True)
    with PeakMemory() as built:
        sess = trainer.setup(plan, opts)
    with PeakMemory() as trained:
        for step in range(args.steps):
            trainer.run_step(sess, step)
    base = built.base_anon_kib / 1024  # MiB before anything of the run was built
    s = plan.memory.stages[0]
    out = {"method": method, "setup_peak": built.peak_anon - base, "after_setup": built.end_anon_kib / 1024 - base,
           "steps_peak": trained.peak_anon - base, "after_steps": trained.end_anon_kib / 1024 - base,
           **tensor_bytes(sess),
           "est_weights": s.params / MiB, "est_grads": s.grads / MiB, "est_optimizer": s.optimizer / MiB,
           "est_activations": s.activations / MiB}
    (Path(args.out) / f"{method}.json").write_text(json.dumps(out))
    trainer.close(sess)


def launch(method: str, args) -> dict:
    import socket

    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(port),
           __file__, "--worker", method, "--out", args.out, "--hidden", str(args.hidden), "--steps", str(args.steps),
           "--rank", str(args.rank), "--precision", args.precision]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{method} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return json.loads((Path(args.out) / f"{method}.json").read_text())


def report(full: dict, lora: dict, args) -> None:
    print(f"llama-tiny widened to hidden {args.hidden}, {args.precision} ZeRO-1, 1 CPU rank, {args.steps} steps; "
          f"LoRA rank {args.rank} on linear_qkv/proj/fc1/fc2: {lora['trainable']:,} trainable of "
          f"{lora['trainable'] + lora['frozen']:,} elements (full: {full['trainable']:,})")
    print(f"{'MiB':36} {'full':>9} {'LoRA':>9}")
    rows = [("measured: weights (modules)", "weights"), ("measured: ZeRO's fp32 partition", "masters"),
            ("measured: Adam's moments", "moments"), ("estimate: weights", "est_weights"),
            ("estimate: gradients", "est_grads"), ("estimate: optimizer states", "est_optimizer"),
            ("estimate: activations", "est_activations"), ("estimate: total (no GPU allowance)", "est_total"),
            ("RssAnon growth: peak in setup", "setup_peak"), ("RssAnon growth: after setup", "after_setup"),
            ("RssAnon growth: peak in the steps", "steps_peak"), ("RssAnon growth: after the steps", "after_steps")]
    for d in (full, lora):
        d["est_total"] = sum(d[k] for k in ("est_weights", "est_grads", "est_optimizer", "est_activations"))
    for name, key in rows:
        print(f"{name:36} {full[key]:9.1f} {lora[key]:9.1f}")
    peak = max(full["setup_peak"], full["steps_peak"]) - max(lora["setup_peak"], lora["steps_peak"])
    print(f"full - LoRA: measured peak RssAnon {peak:.1f} MiB, estimated {full['est_total'] - lora['est_total']:.1f} "
          f"MiB; after the steps {full['after_steps'] - lora['after_steps']:.1f} MiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512, help="hidden size of the widened llama-tiny (heads of 32)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "lora_memory"), help="scratch folder")
    p.add_argument("--worker", choices=["full", "lora"], help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args)
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    full, lora = launch("full", args), launch("lora", args)
    report(full, lora, args)


if __name__ == "__main__":
    main()
