"""Kill and resume (issue 42's check): a tiny run on 2 CPU ranks, SIGKILLed at random moments
(some inside saves) and relaunched each time with the same command line, ends with the
uninterrupted run's metrics, bit for bit, in five layouts.

    PYTHONPATH=. python benchmarks/kill_resume.py [--kills 4] [--steps 12] [--save-interval 2] [--seed 0] \\
        [--layouts dp-zero1,dp-zero3,tp2,pp2,ep2] [--async-save] [--work DIR]

Per layout, one recipe command line (`torchrun --nproc_per_node 2 --master_port P recipes/R.py
--flavor tiny --steps S --out DIR --resume --set train.save_interval=I ...`) is run once
uninterrupted into its own folder, then --kills times into another folder, each launch killed at
a random moment, then once more to the end. A moment, counted from the launch's first step
line, is drawn uniformly from [0, T x 2 / (K + 1)], T the time the uninterrupted run took from
its first step line to its last (training and saving; start-up and teardown left out) scaled
by the share of steps left after the launch's first one, and K the kills left (so that the kills
spread over the run on average, not the first one taking most of it): then the launcher and every process under it (the ranks, in their
own sessions under torchrun; with train.async_save megatron's forked writers and its results
queue's process) get SIGKILL, each process group at once, as a node failure ends them. A kill
landed inside a save when a `.global_step<N>.partial-*` folder the launch created is left
behind (a save that did not finish; a background save in flight counts). A kill that comes after
the run's last checkpoint is complete (during the launch's teardown) leaves nothing to train:
that layout then has fewer kills, as it says. The check: the
killed run's metrics.jsonl holds each step once (the runtime drops the rows of steps after the
checkpoint a launch resumes from, toolkit.runtime.trainer.prepare_out) with the uninterrupted
run's loss, lr and grad_norm, bit for bit (the same floats). Exits 1 if any layout differs.
Each launch takes about a minute on a 2-core machine, most of it imports and setup.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RECIPES = ROOT / "recipes"
LAYOUTS = {  # name: (recipe, --set items); the tiny flavours of the README's layout table
    "dp-zero1": ("llama8b.py", ["zero.stage=1"]),
    "dp-zero3": ("llama8b.py", ["zero.stage=3"]),
    "tp2": ("llama70b.py", ["parallel.tp=2"]),
    "pp2": ("llama70b.py", ["parallel.pp=2"]),
    "ep2": ("mixtral8x7b.py", ["parallel.ep=2"]),
}
STEP_LINE = "step "  # rank 0's line per step: "step     3/12 | loss ..."


def command(layout: str, out: Path, port: int, args) -> list[str]:
    recipe, sets = LAYOUTS[layout]
    sets = [*sets, f"train.save_interval={args.save_interval}", *(["train.async_save=true"] if args.async_save else [])]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
            str(RECIPES / recipe), "--flavor", "tiny", "--steps", str(args.steps), "--out", str(out), "--resume",
            *(x for s in sets for x in ("--set", s))]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": "1"}


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def step_lines(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if line.startswith(STEP_LINE)]


def wait_first_step(p: subprocess.Popen, log: Path) -> float | None:
    """The time rank 0 printed its first step line, or None when the launch ended first."""
    while p.poll() is None:
        if step_lines(log):
            return time.monotonic()
        time.sleep(0.05)
    return None


def kill_tree(p: subprocess.Popen) -> int:
    """SIGKILL to the process group of the launcher and of every process under it (torchrun starts
    each rank in a session of its own); returns how many processes there were."""
    import psutil

    procs = [psutil.Process(p.pid)]
    with suppress(psutil.NoSuchProcess):  # the launcher may have ended already
        procs += procs[0].children(recursive=True)
    groups = set()
    for q in procs:
        with suppress(ProcessLookupError):  # a process gone since: its group goes with the others
            groups.add(os.getpgid(q.pid))
    for g in groups:
        with suppress(ProcessLookupError):
            os.killpg(g, signal.SIGKILL)
    p.wait()
    psutil.wait_procs(procs[1:], timeout=30)
    return len(procs)


def release_shm(port: int) -> None:
    """DeepSpeed's CPU all-reduce segments of a killed launch (its ranks unlink them after start-up;
    a launch killed before that leaves them: toolkit.mcore.cpu_compat.release_deepspeed_shm)."""
    for seg in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        seg.unlink(missing_ok=True)


def partials(root: Path) -> set[str]:
    return {p.name for p in root.glob(".global_step*.partial-*")} if root.exists() else set()


def resumes_at(root: Path) -> int:
    from toolkit.runtime.checkpoint_folder import resume_point, saved_state

    found = resume_point(root) if root.exists() else None
    return saved_state(found)["step"] if found else 0


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_whole(cmd: list[str], log: Path) -> float:
    """A launch to its end; returns the seconds from its first step line to its last (the time it
    trained and saved, its start-up and teardown left out)."""
    p, seen, first, last = start(cmd, log), 0, None, None
    while p.poll() is None:
        n = len(step_lines(log))
        if n != seen:
            seen, last = n, time.monotonic()
            first = first or last
        time.sleep(0.05)
    if p.returncode != 0 or first is None:
        raise SystemExit(f"launch failed (exit {p.returncode}): {' '.join(cmd)}\n{log.read_text()[-3000:]}")
    return last - first


def killed_launch(cmd: list[str], log: Path, root: Path, span: float, steps: int, kills_left: int,
                  rng: random.Random, port: int) -> dict:
    """One launch killed at a random moment of its training; what the kill hit."""
    at = resumes_at(root)
    before = partials(root)
    p = start(cmd, log)
    first = wait_first_step(p, log)
    if first is None and p.returncode == 0 and resumes_at(root) == steps:
        return {}  # an earlier kill came after the last checkpoint was complete: nothing was left to train
    if first is None:
        raise SystemExit(f"launch ended before its first step (exit {p.returncode})\n{log.read_text()[-3000:]}")
    moment = rng.uniform(0.0, min(1.0, 2 / (kills_left + 1)) * span * max(steps - at - 1, 0) / (steps - 1))
    time.sleep(max(0.0, first + moment - time.monotonic()))
    finished = p.poll() is not None
    procs = kill_tree(p)
    release_shm(port)
    left = sorted(partials(root) - before)
    printed = step_lines(log)
    return {"resumed_at": at, "moment_s": round(moment, 2), "finished_first": finished, "processes": procs,
            "last_step_printed": int(printed[-1].split()[1].split("/")[0]) if printed else None,
            "inside_save": [n.split(".partial-")[0].lstrip(".") for n in left],
            "latest": (root / "latest").read_text() if (root / "latest").exists() else None}


def compare(ref: list[dict], got: list[dict]) -> str | None:
    """None when `got` is `ref` step for step (loss, lr, grad_norm bit for bit), else what differs."""
    keys = ("step", "loss", "lr", "grad_norm")
    if [m["step"] for m in got] != [m["step"] for m in ref]:
        return f"steps {[m['step'] for m in got]} against {[m['step'] for m in ref]}"
    bad = [(a["step"], {k: (a[k], b[k]) for k in keys if a[k] != b[k]}) for a, b in zip(ref, got)
           if any(a[k] != b[k] for k in keys)]
    return f"differ at {bad}" if bad else None


def one_layout(layout: str, port: int, args, rng: random.Random) -> dict:
    work = Path(args.work) / layout
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.monotonic()
    span = run_whole(command(layout, work / "ref", port, args), work / "ref.log")
    out, kills = work / "run", []
    cmd = command(layout, out, port, args)
    for k in range(args.kills):
        kill = killed_launch(cmd, work / f"kill{k}.log", out / "checkpoints", span, args.steps, args.kills - k, rng,
                             port)
        if not kill:
            print(f"  {layout}: the run was complete before kill {k + 1} (the last one came after its last save)")
            break
        kills.append(kill)
        print(f"  {layout} kill {k + 1}: {kills[-1]}", flush=True)
    run_whole(cmd, work / "last.log")
    ref, got = metrics(work / "ref"), metrics(out)
    return {"layout": layout, "kills": kills, "differs": compare(ref, got), "steps": len(got),
            "train_span_s": round(span, 1), "minutes": round((time.monotonic() - t0) / 60, 1),
            "last_loss": got[-1]["loss"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=4, help="killed launches per layout")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-interval", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="of the kill moments")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--async-save", action="store_true", help="train.async_save=true in every launch")
    p.add_argument("--port", type=int, default=19431, help="the rendezvous port of layout i is PORT + i")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "kill_resume"), help="run folders and logs")
    args = p.parse_args()
    rng, results = random.Random(args.seed), []
    for i, layout in enumerate(args.layouts.split(",")):
        print(f"{layout}: {' '.join(command(layout, Path(args.work) / layout / 'run', args.port + i, args)[1:])}",
              flush=True)
        results.append(one_layout(layout, args.port + i, args, rng))
        r = results[-1]
        print(f"{layout}: {len(r['kills'])} kills, {sum(bool(k['inside_save']) for k in r['kills'])} inside saves; "
              f"metrics {'identical to the uninterrupted run (' + str(r['steps']) + ' steps)' if not r['differs'] else r['differs']}"
              f"; {r['minutes']} min", flush=True)
    kills = [k for r in results for k in r["kills"]]
    print(f"total: {len(kills)} kills ({sum(bool(k['inside_save']) for k in kills)} inside saves, "
          f"{sum(k['finished_first'] for k in kills)} after the launch had finished); "
          f"{sum(r['differs'] is None for r in results)}/{len(results)} layouts identical; load average "
          f"{os.getloadavg()[0]:.1f}")
    (Path(args.work) / "summary.json").write_text(json.dumps(results, indent=1))
    raise SystemExit(0 if all(r["differs"] is None for r in results) else 1)


if __name__ == "__main__":
    main()
