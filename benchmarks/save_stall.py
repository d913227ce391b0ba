"""How long a checkpoint save stops training: synchronous against asynchronous
(train.async_save: megatron-core's async dist_checkpointing, toolkit.runtime.async_save),
side by side in one run.

    PYTHONPATH=. python benchmarks/save_stall.py [--hidden 1152] [--ranks 1] [--rounds 3] [--window 4] [--shared-cores]

The llama8b recipe's tiny flavour widened to --hidden (benchmarks/recipe_overhead.make_spec:
4 layers, ffn 4x hidden; 1152: 80 M parameters), fp32, ZeRO-1, a global batch of 2 sequences
of 64 tokens, on --ranks CPU ranks (torchrun). Its state, weights + fp32 masters + Adam's two
moments, is printed (at least 1 GiB at the default size). One process per rank trains:
--rounds times, three windows of --window steps each: one without a save, one whose first
step is followed by a synchronous save, and one whose first step is followed by an
asynchronous save (finished, if still pending, at the end of its window). A first round, not
counted, warms up (the results queue's process starts at the first background save; the page
cache). Per save: **stall** = the window's wall time minus the same round's window without a
save (what the save cost the run, the steps slowed by a writer running beside them included;
on a busy machine the steps' own spread is in it too), **blocked** = the time the loop spent
inside the save calls: the save call (for a background save: gathering the state, megatron's
planning, the fork) and completing (the per-step check, the final wait, and the completion:
checksums, train_state.json, rename, pruning), rank 0's; medians over the rounds. The saves
go to --out (deleted at the end); each checkpoint is complete (train_state.json with every
file's CRC-32, ``latest``) before its window ends.

By default the writers get cores of their own, as a GPU node's host CPUs leave them: rank r
trains on one thread (torch.set_num_threads(1)) pinned to the r-th core this process may use
(os.sched_setaffinity), and every process under a rank (megatron's forked writer, its own
forked writers, the results queue's process) is pinned to the cores left over, after every step
and save call (outside the timed calls); it needs more cores than ranks. --shared-cores leaves
all of them to the scheduler (and torch its default threads), as before. Pinning keeps the
run's own processes apart; it does not keep other work on the machine off the writers' cores,
so the load average is printed before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
GiB = 1024**3


class Clock:
    """Seconds spent inside the timed calls."""

    def __init__(self) -> None:
        self.blocked = 0.0

    def __call__(self, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self.blocked += time.perf_counter() - start
        return out


def window(sess, trainer, async_save, steps: int, saves, pin=lambda: None) -> tuple[float, float, float]:
    """`steps` steps, the first followed by a save (`saves`: the async queue, or None: synchronous)
    unless `saves` is False; returns (wall seconds, seconds in the save call, seconds in the
    completion checks after each step and the final wait). `pin` moves the rank's children to
    their cores after each step and save call."""
    in_save, completing = Clock(), Clock()
    sess.saves = saves or None
    start = time.perf_counter()
    for i in range(steps):
        trainer.run_step(sess, sess.state.step)
        completing(async_save.poll, sess.saves)
        if i == 0 and saves is not False:
            in_save(trainer.save_checkpoint, sess)
        pin()
    completing(async_save.finish, sess.saves)
    return time.perf_counter() - start, in_save.blocked, completing.blocked


def cores(rank: int, ranks: int) -> tuple[set[int], set[int]]:
    """(rank's training core, the writers' cores): the r-th core this process may use, and those
    after the ranks' own."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) <= ranks:
        raise SystemExit(f"--ranks {ranks} on {len(mine)} cores leaves the writers none: use fewer ranks "
                         "or --shared-cores")
    return {mine[rank]}, set(mine[ranks:])


def pin_children(spare: set[int], pinned: set[int]) -> None:
    """Every process under this one onto the `spare` cores (one that ended meanwhile is passed
    over); adds their pids to `pinned`."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        with suppress(psutil.NoSuchProcess):  # a process that ended meanwhile needs no core
            if set(child.cpu_affinity()) != spare:
                child.cpu_affinity(sorted(spare))
            pinned.add(child.pid)


def state_bytes(sess) -> int:
    """Every rank's weights, fp32 masters and moments (all ranks' sum)."""
    import torch
    import torch.distributed as dist

    from lora_memory import tensor_bytes

    b = tensor_bytes(sess)
    mine = (b["masters"] + b["moments"]) * 1024**2
    t = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(t)
    return int(t.item() + b["weights"] * 1024**2)  # the weights are whole on every rank (ZeRO-1)


def worker(args) -> None:
    import torch.distributed as dist

    from recipe_overhead import make_spec

    from toolkit.mcore.distributed import init_process_group
    from toolkit.plan import make_plan
    from toolkit.runtime import async_save, trainer

    init_process_group()
    pin, pinned = lambda: None, set()
    if not args.shared_cores:
        import torch

        train_core, spare = cores(dist.get_rank(), dist.get_world_size())
        torch.set_num_threads(1)
        os.sched_setaffinity(0, train_core)
        pin = lambda: pin_children(spare, pinned)
    spec_args = argparse.Namespace(sets=["zero.stage=1", "recompute=none", "batch.global=2", "batch.micro=1",
                                         "train.steps=1000", "train.keep_checkpoints=1", "precision=fp32"],
                                   hidden=args.hidden, out=args.out)
    plan = make_plan(make_spec(spec_args)).require_valid()
    sess = trainer.setup(plan, trainer.RunOptions(out=Path(args.out) / "run", data=trainer.BUILTIN, overwrite=True))
    trainer.prepare_out(plan, sess.opts, 0)
    queue = async_save.queue()
    for _ in range(2):
        trainer.run_step(sess, sess.state.step)
    rows, plain = {"sync": [], "async": []}, []
    for r in range(args.rounds + 1):  # round 0: the warm-up of each kind
        walls = {}
        for kind, saves in (("none", False), ("sync", None), ("async", queue)):
            walls[kind] = window(sess, trainer, async_save, args.window, saves, pin)
        if r:
            plain.append(walls["none"][0] / args.window)
            for kind in rows:
                wall, in_save, completing = walls[kind]
                rows[kind].append((wall - walls["none"][0], in_save + completing, in_save, completing))
    out = {"state_bytes": state_bytes(sess), "step_s": statistics.median(plain), "steps_s": plain, "rows": rows,
           "ckpt_bytes": sum(f.stat().st_size for f in (Path(args.out) / "run" / "checkpoints").rglob("*")
                             if f.is_file())}
    out["cores"] = "shared" if args.shared_cores else {"train": sorted(train_core), "writers": sorted(spare),
                                                           "pinned": len(pinned)}
    if dist.get_rank() == 0:
        (Path(args.out) / "result.json").write_text(json.dumps(out))
    trainer.close(sess)


def launch(args) -> dict:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks), "--master_port",
           str(port), __file__, "--worker", "--out", args.out, "--hidden", str(args.hidden), "--rounds",
           str(args.rounds), "--window", str(args.window), *(["--shared-cores"] if args.shared_cores else [])]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"the run failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return json.loads((Path(args.out) / "result.json").read_text())


def report(res: dict, args) -> None:
    print(f"llama-tiny widened to hidden {args.hidden}, fp32 ZeRO-1, {args.ranks} CPU rank(s): state (weights + "
          f"fp32 masters + Adam moments) {res['state_bytes'] / GiB:.2f} GiB, checkpoint {res['ckpt_bytes'] / GiB:.2f} "
          f"GiB; step {res['step_s']:.2f} s (median of the windows without a save: {[round(s, 2) for s in res['steps_s']]}); "
          f"load average {load(args.load_before)} before, {load(os.getloadavg())} after")
    c = res["cores"]
    print("cores: shared (torch's default threads)" if c == "shared" else
          f"cores: rank 0 trains on core {c['train']} (1 thread), the writers on {c['writers']} ({c['pinned']} "
          "processes under rank 0 pinned there: writers, their workers, the results queue's process)")
    print(f"{'seconds per save':28} {'sync':>8} {'async':>8}")
    names = ("stall (window - no-save window)", "blocked in save calls", "  in save()", "  completing (poll, finish)")
    for i, name in enumerate(names):
        sync, asy = (statistics.median(v[i] for v in res["rows"][k]) for k in ("sync", "async"))
        print(f"{name:28} {sync:8.2f} {asy:8.2f}")
    for k in ("sync", "async"):
        print(f"  {k} rounds (stall, blocked, in save, completing): {[tuple(round(x, 2) for x in v) for v in res['rows'][k]]}")


def load(avg) -> str:
    return "/".join(f"{x:.1f}" for x in avg) + " (1/5/15 min)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1152, help="hidden size of the widened llama-tiny (a multiple of 64)")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window", type=int, default=4, help="steps per measured window")
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "save_stall"), help="scratch folder")
    p.add_argument("--shared-cores", action="store_true",
                   help="do not pin: the ranks and the writers share every core (torch's default threads)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    args.load_before = os.getloadavg()
    try:
        report(launch(args), args)
    finally:
        shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()
