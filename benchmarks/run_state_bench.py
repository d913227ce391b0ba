"""Training state of a real-shape model: converting it against `cp -r` of the same bytes, resuming it
against reading them, each timed until the bytes are on the disk or read from it.

    python benchmarks/run_state_bench.py --work DIR [--model qwen2-0.5b] [--rounds 2] [--keep]

1. Once (kept in DIR/run): the runtime trains the model for one step on 2 CPU ranks (bf16
   weights, ZeRO-1, DeepSpeed's bf16 optimizer: bf16 weights + fp32 masters + two fp32
   moments = 14 bytes per parameter; Qwen2-0.5B: 494 M parameters, 6.44 GiB) and saves it.
2. Conversions, --rounds interleaved rounds: in each round every row runs `python -m toolkit
   convert run-state SRC OUT --to FMT`, then `cp -r OUT COPY`: the same bytes in the same files,
   each a separate process watched from outside (benchmarks.memory.run_watched: wall time to
   exit, CPU seconds, the kernel's peak RSS, the sampled peak of RssAnon, helper processes
   included; and the machine's CPU seconds over the run and its `sync`, /proc/stat's: every
   process and kernel thread, such as the write-back workers that flush what `cp` left).
   Before each run its source is read once (page cache warm) and dirty pages are flushed;
   each run's time is to exit plus the `sync` that follows it, so both are timed until their
   bytes are on the disk (the conversion fsyncs its output before renaming it into
   place, so its `sync` finds little left; `cp` leaves it all to `sync`).
   Rows: runtime -> universal / megatron-lm / hf, and back from universal and megatron-lm (the
   source of a "-> runtime" row is the same round's output of the row before it).
3. Resume: the runtime's setup with `--load` of the checkpoint on 2 ranks (torchrun), at the
   layout that saved it (dp2) and at another (tp2), from a cold page cache (caches dropped
   through /proc/sys/vm/drop_caches; warm, and said so, where that cannot be written), against
   reading every byte of the checkpoint once from a cold cache: seconds in
   checkpoint.load_weights + checkpoint.load (masters and moments through DeepSpeed's
   accessors), each rank's peak RSS / RssAnon over its whole setup, and what the load adds:
   RssAnon right before checkpoint.load, after it created the optimizer state
   (optim_state.prime), its peak during the load and after it, next to the rank's own share
   of the checkpoint (its weights; its data-parallel part of masters and moments). The
   seconds of optim_state.prime are printed apart, with its page faults: creating the
   moments touches their memory for the first time, which any resume (and DeepSpeed's first
   step) pays whatever the disk.
   Beside them, the baseline nobody here wrote: the same training state saved by DeepSpeed's
   own ``engine.save_checkpoint`` (its module file and per-rank ZeRO optimizer files, written
   once into DIR/run/deepspeed from the runtime's checkpoint) and loaded by DeepSpeed's own
   ``engine.load_checkpoint`` at the layout that saved it (the only one it can load at), timed
   the same way from a cold page cache, against one cold read of its files. Last, what this
   machine charges for new memory with no toolkit code: two processes at once, each holding as
   much as a rank held before its optimizer load, each touching as much new anonymous memory as
   creating the optimizer state added.
4. Fixed cost (``--fixed-model``, default llama-tiny, 2.9 MB of state): every conversion row
   also runs on that model's trained state in each round; its wall time is what a conversion
   costs whatever the size (interpreter start, imports, metadata), and "(ours - fixed) / cp"
   compares the part that grows with the bytes against ``cp -r``.
Medians of wall time over the rounds, maxima of memory. MB/s: bytes written / time (resume:
checkpoint bytes / load seconds). Prints one table with the load average; numbers also go to
DIR/results.json. Outputs are deleted at the end, the trained checkpoint too unless --keep.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.convert_bench import size, timed_sync, warm  # noqa: E402
from benchmarks.memory import PeakMemory, machine_busy_seconds, run_watched, status_kib  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
       "OMP_NUM_THREADS": "1"}
BATCH = {"micro": 1, "global": 2, "seq_len": 32}
# (label, source, format, output): source/output name DIR/<name>; "runtime" is the trained checkpoint
ROWS = [("runtime -> universal", "runtime", "universal", "uc"),
        ("universal -> runtime", "uc", "runtime", "back"),
        ("runtime -> megatron-lm", "runtime", "megatron-lm", "mlm"),
        ("megatron-lm -> runtime", "mlm", "runtime", "back"),
        ("runtime -> hf", "runtime", "hf", "hf")]
RESUMES = {"resume dp2 (same layout)": {}, "resume tp2 (another layout)": {"parallel.tp": 2}}
# DeepSpeed's own checkpoint of the same state (engine.save_checkpoint: its module file and
# per-rank ZeRO optimizer files), loaded by DeepSpeed's own engine.load_checkpoint at the layout
# that saved it (it cannot load it at another): the baseline for what a resume costs
DEEPSPEED_RESUME = "DeepSpeed's own load_checkpoint, dp2 (same layout only)"
DS_TAG = "step1"
RESUMES[DEEPSPEED_RESUME] = {}


def spec(model: str, sets: dict):
    from toolkit.spec import TrainingSpec

    return TrainingSpec.from_dict({
        "model": model, "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "cpu"}, "parallel": {},
        "zero": {"stage": 1}, "precision": "bf16", "batch": BATCH, "recompute": "none",
        "optimizer": {"lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 0},
        "train": {"steps": 1, "save_interval": 1, "log_interval": 1}}).with_overrides(sets)


def rank_main(mode: str, out: str, model: str, load: str | None, sets: str) -> None:
    """On each rank: train one step and save (mode "train"), or set up from a checkpoint (mode
    "resume") and report the load seconds and this rank's peak RSS / RssAnon (MiB); "ds-save" /
    "ds-resume": DeepSpeed's own save_checkpoint / load_checkpoint of the same state."""
    from toolkit.plan import make_plan
    from toolkit.quiet import quiet_run
    from toolkit.runtime import checkpoint, optim_state, trainer

    quiet_run(cpu=True, transformer_engine=False)  # CPU ranks, megatron's local layers
    plan = make_plan(spec(model, json.loads(sets))).require_valid()
    opts = trainer.RunOptions(out=Path(out), data="builtin", load=load, overwrite=True)
    if mode == "train":
        trainer.close(trainer.train(plan, opts))
        return
    if mode == "ds-save":  # our checkpoint resumed, saved again by DeepSpeed's own save_checkpoint
        sess = trainer.setup(plan, opts)
        sess.engine.save_checkpoint(str(Path(out) / "deepspeed"), tag=DS_TAG)
        trainer.close(sess)
        return
    if mode == "ds-resume":
        ds_resume(plan, replace(opts, load=None), load)
        return
    timed, mem, shares, faults = {}, {}, {}, {}
    for name in ("load_weights", "load"):
        real = getattr(checkpoint, name)

        def wrapped(*a, _real=real, _name=name, **k):
            cat = a[1] if _name == "load_weights" else a[2]
            shares[_name] = share(cat, _name)
            start = time.perf_counter()
            with PeakMemory(reset=False) as during:
                result = _real(*a, **k)
            timed[_name] = time.perf_counter() - start
            mem[_name] = {"before": during.base_anon, "peak": during.peak_anon, "after": during.end_anon}
            return result

        setattr(checkpoint, name, wrapped)
    real_prime = optim_state.prime

    def prime(*a, **k):
        with faulted(timed, faults, "prime"):
            real_prime(*a, **k)
        mem["primed"] = status_kib("RssAnon")["RssAnon"] / 1024

    optim_state.prime = prime
    with PeakMemory() as m:
        sess = trainer.setup(plan, opts)
    mine = {"seconds": timed, "rss": max(m.peak_rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "anon": m.peak_anon, "load_anon": mem, "share": shares, "faults": faults}
    gather_to(Path(out), mine)
    trainer.close(sess)  # DeepSpeed's and megatron's teardown, as the runtime ends a run


@contextlib.contextmanager
def faulted(timed: dict, faults: dict, name: str):
    """The block's seconds into timed[name], its page faults and kernel CPU seconds into faults[name]."""
    start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    yield
    after = resource.getrusage(resource.RUSAGE_SELF)
    timed[name] = time.perf_counter() - start
    faults[name] = {"minor": after.ru_minflt - before.ru_minflt, "sys": after.ru_stime - before.ru_stime}


def gather_to(out: Path, mine: dict) -> None:
    """Every rank's numbers into out/resume.json (collective; rank 0 writes)."""
    import torch.distributed as dist

    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "resume.json").write_text(json.dumps(got))


def ds_resume(plan, opts, ds_dir: str) -> None:
    """On each rank: set up without a checkpoint, then DeepSpeed's own engine.load_checkpoint of
    its own checkpoint (module, ZeRO optimizer partitions, scheduler), timed as the runtime's
    load is, with its page faults."""
    from toolkit.runtime import trainer

    timed, faults = {}, {}
    with PeakMemory() as m:
        sess = trainer.setup(plan, opts)
        with PeakMemory(reset=False) as during, faulted(timed, faults, "deepspeed_load"):
            path, _ = sess.engine.load_checkpoint(ds_dir, tag=DS_TAG)
    if path is None:
        raise SystemExit(f"DeepSpeed found no checkpoint in {ds_dir}")
    mine = {"seconds": timed, "faults": faults,
            "rss": max(m.peak_rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024), "anon": m.peak_anon,
            "deepspeed_anon": {"before": during.base_anon, "peak": during.peak_anon, "after": during.end_anon}}
    gather_to(Path(opts.out), mine)
    trainer.close(sess)


def share(cat, what: str) -> float:
    """MiB of the checkpoint that is this rank's own: its weights (load_weights: every rank of
    a data-parallel group holds them whole), or its data-parallel part of the fp32 master and
    two moments (load: what DeepSpeed keeps of them on this rank)."""
    import torch.distributed as dist

    if what == "load_weights":
        return sum(e.numel * e.param.element_size() for e in cat.entries) / 2**20
    return sum(12 * e.numel / dist.get_world_size(group=e.group) for e in cat.entries) / 2**20


def torchrun(*args: str) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, *args]
    start = time.perf_counter()
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return time.perf_counter() - start


def watched(cmd: list[str], src: Path, out: Path) -> dict:
    """One run of `cmd` reading `src` (page cache warm), writing `out` (kept), timed until its
    bytes are on the disk: wall s to exit + the `sync` after it (flush s), CPU s, peak RSS /
    RssAnon MiB, bytes written."""
    shutil.rmtree(out, ignore_errors=True)
    check_space(out.parent, size(src) + (4 << 30))
    warm(src)
    busy = machine_busy_seconds()
    w = run_watched(cmd, env=ENV)
    if w.code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({w.code}): {w.stderr[-3000:]}")
    flush = timed_sync()
    return {"wall": w.wall + flush, "flush": flush, "cpu": w.cpu, "machine_cpu": machine_busy_seconds() - busy,
            "rss": w.rss, "anon": w.anon, "bytes": size(out)}


def cp_r(src: Path, work: Path) -> dict:
    """`cp -r` of `src`, timed as `watched` times a conversion; the copy is deleted."""
    copy = work / "copy"
    r = watched(["cp", "-r", str(src), str(copy)], src, copy)
    shutil.rmtree(copy)
    subprocess.run(["sync"], check=True)
    return r


def drop_caches() -> bool:
    """Empty the page cache (after a sync); False when this process may not."""
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def read_all(d: Path) -> tuple[float, bool]:
    """Seconds to read every file of `d` once from a cold page cache (or a warm one: the bool
    says which)."""
    cold = drop_caches()
    start = time.perf_counter()
    for f in sorted(d.rglob("*")):
        if f.is_file():
            with open(f, "rb") as src, open(os.devnull, "wb") as sink:
                shutil.copyfileobj(src, sink, 1 << 24)
    return time.perf_counter() - start, cold


TOUCH = """import mmap, resource, sys, time
held, n = (int(x) << 20 for x in sys.argv[1:3])
h = mmap.mmap(-1, held)
h[::4096] = b"\\1" * (held // 4096)
m = mmap.mmap(-1, n)
r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
m[::4096] = b"\\1" * (n // 4096)
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_stime - r0.ru_stime)
"""


def first_touch(held_mib: int, mib: int, procs: int = 2) -> list[list[float]]:
    """[seconds, kernel seconds] for each of `procs` processes at once, each already holding
    `held_mib` MiB (as a rank holds its engine before the load), writing one byte per page of
    `mib` MiB of new anonymous memory, right after the page cache was dropped: what creating the
    optimizer state's memory costs on this machine whatever the code (a virtual machine whose
    guest returns free memory to its host, page_reporting, pays the host again for each page it
    takes back)."""
    drop_caches()
    time.sleep(3)  # let freed pages be reported, as after the resume's own drop_caches
    runs = [subprocess.Popen([sys.executable, "-c", TOUCH, str(held_mib), str(mib)], stdout=subprocess.PIPE,
                             text=True) for _ in range(procs)]
    return [[float(x) for x in r.communicate()[0].split()] for r in runs]


def check_space(where: Path, need: int) -> None:
    free = shutil.disk_usage(where).free
    if free < need:
        raise SystemExit(f"{free / 2**30:.1f} GiB free on {where}'s disk, {need / 2**30:.1f} GiB needed; stopping")


def convert(src: Path, out: Path, to: str) -> list[str]:
    return [sys.executable, "-m", "toolkit", "convert", "run-state", str(src), str(out), "--to", to, "--overwrite"]


def trained(run_dir: Path, model: str) -> Path:
    """The checkpoint of one step of `model` trained on 2 ranks in `run_dir` (kept between runs)."""
    source = run_dir / "checkpoints" / "global_step1"
    if not source.is_dir():
        torchrun("--rank-main", "train", str(run_dir), model, "", "{}")
    return source


def deepspeed_checkpoint(run_dir: Path, model: str, source: Path) -> Path:
    """DeepSpeed's own checkpoint of the same training state (kept beside the runtime's)."""
    ds_dir = run_dir / "deepspeed"
    if not (ds_dir / DS_TAG).is_dir():
        torchrun("--rank-main", "ds-save", str(run_dir), model, str(source), "{}")
    return ds_dir


def run(work: Path, model: str, rounds: int, rows: list, resumes: dict, fixed_model: str | None) -> dict:
    source = trained(work / "run", model)
    folders = {"runtime": source}
    small = {"runtime": trained(work / "fixed_run", fixed_model)} if fixed_model and rows else None
    got = {"state_bytes": size(source), "loadavg": [], "rows": {r[0]: {"cp": [], "ours": [], "fixed": []} for r in rows},
           "fixed_model": fixed_model, "fixed_bytes": size(small["runtime"]) if small else None}
    for _ in range(rounds):
        for label, src, to, out in rows:
            got["loadavg"].append(os.getloadavg())
            folders[out] = work / out
            got["rows"][label]["ours"].append(watched(convert(folders[src], folders[out], to), folders[src],
                                                      folders[out]))
            got["rows"][label]["cp"].append(cp_r(folders[out], work))
            if small:
                small[out] = work / f"fixed_{out}"
                got["rows"][label]["fixed"].append(watched(convert(small[src], small[out], to), small[src],
                                                           small[out])["wall"])
    for out in {r[3] for r in rows}:
        shutil.rmtree(work / out, ignore_errors=True)
        shutil.rmtree(work / f"fixed_{out}", ignore_errors=True)
    for label, sets in resumes.items():
        got["loadavg"].append(os.getloadavg())
        deepspeed = label == DEEPSPEED_RESUME
        folder = deepspeed_checkpoint(work / "run", model, source) if deepspeed else source
        read, cold = read_all(folder)
        if not (cold and drop_caches()):
            warm(folder)
        mode, load = ("ds-resume", folder) if deepspeed else ("resume", source)
        launch = torchrun("--rank-main", mode, str(work / "resumed"), model, str(load), json.dumps(sets))
        got["rows"][label] = {"read": read, "cold": cold, "launch": launch, "bytes": size(folder),
                              "ranks": json.loads((work / "resumed" / "resume.json").read_text())}
        shutil.rmtree(work / "resumed")
    ours = [k["load_anon"] for r in got["rows"].values() for k in r.get("ranks", []) if "primed" in k.get("load_anon", {})]
    if ours:
        held, mib = round(max(a["load"]["before"] for a in ours)), round(max(a["primed"] - a["load"]["before"] for a in ours))
        got["first_touch"] = {"held_mib": held, "mib": mib, "runs": first_touch(held, mib)}
    return got


def report(got: dict, rounds: int) -> None:
    mb, gib, nan = 1e6, got["state_bytes"] / 2**30, float("nan")
    print(f"\ntraining state: {gib:.2f} GiB ({got['state_bytes']:,} bytes); {rounds} interleaved round(s); "
          f"load average (1, 5, 15 min) before each row: min {min(a[0] for a in got['loadavg']):.2f}, "
          f"max {max(a[0] for a in got['loadavg']):.2f} (1 min); at the end {os.getloadavg()}\n")
    if got.get("fixed_bytes"):
        print(f"fixed: the same conversion of {got['fixed_model']}'s trained state ({got['fixed_bytes'] / 1e6:.1f} MB)\n")
    print("Conversions, each run timed to exit + the `sync` after it (the bytes on the disk); cp: `cp -r` of the "
          "conversion's output (the same files)\n")
    print("| direction | cp -r + sync s | ours + sync s | ours / cp | fixed s | (ours - fixed) / cp | MB/s cp | MB/s ours "
          "| CPU s cp / ours | machine CPU s cp / ours | out GiB | peak RSS MiB | peak RssAnon MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    conversions = {label: r for label, r in got["rows"].items() if "ours" in r}
    for label, r in conversions.items():
        cp = statistics.median(c["wall"] for c in r["cp"])
        wall = statistics.median(o["wall"] for o in r["ours"])
        rate = statistics.median(o["bytes"] / o["wall"] / mb for o in r["ours"])
        cp_rate = statistics.median(c["bytes"] / c["wall"] / mb for c in r["cp"])
        fixed = statistics.median(r["fixed"]) if r.get("fixed") else None
        grows = "- | -" if fixed is None else f"{fixed:.1f} | {(wall - fixed) / cp:.2f}"
        cpu = " | ".join(f"{statistics.median(c.get(k, nan) for c in r['cp']):.1f} / "
                         f"{statistics.median(o.get(k, nan) for o in r['ours']):.1f}" for k in ("cpu", "machine_cpu"))
        print(f"| {label} | {cp:.1f} | {wall:.1f} | {wall / cp:.2f} | {grows} | {cp_rate:.0f} | {rate:.0f} | {cpu} | "
              f"{r['ours'][0]['bytes'] / 2**30:.2f} | {max(o['rss'] for o in r['ours']):.0f} | "
              f"{max(o['anon'] for o in r['ours']):.0f} |")
    print("\neach round, ours / cp: " + "; ".join(
        f"{label} " + " ".join(f"{o['wall'] / c['wall']:.2f}" for c, o in zip(r["cp"], r["ours"]))
        for label, r in conversions.items()))
    print("each round, seconds the `sync` after the run took, cp / ours: " + "; ".join(
        f"{label} " + " ".join(f"{c['flush']:.1f}/{o['flush']:.1f}" for c, o in zip(r["cp"], r["ours"]))
        for label, r in conversions.items()))
    resumes = {label: r for label, r in got["rows"].items() if "ranks" in r}
    if resumes:
        print("\nResume: checkpoint.load_weights + checkpoint.load (the slower rank) against reading every byte of "
              "the checkpoint once, both from a " + ("cold" if all(r["cold"] for r in resumes.values()) else
                                                    "WARM (drop_caches not writable)") + " page cache\n")
        print("| resume | read s | load s | load / read | MB/s read | MB/s load | peak RSS MiB per rank "
              "| peak RssAnon MiB per rank |")
        print("|---|---|---|---|---|---|---|---|")
    for label, r in resumes.items():
        ranks, nbytes = r["ranks"], r.get("bytes", got["state_bytes"])
        load = max(load_seconds(k) for k in ranks)
        print(f"| {label} | {r['read']:.1f} | {load:.1f} | {load / r['read']:.2f} | "
              f"{nbytes / r['read'] / mb:.0f} | {nbytes / load / mb:.0f} | "
              f"{' / '.join(format(k['rss'], '.0f') for k in ranks)} | "
              f"{' / '.join(format(k['anon'], '.0f') for k in ranks)} |")
    ours = {label: r for label, r in resumes.items() if all("load_anon" in k for k in r["ranks"])}
    if ours:
        print("\nmemory the load adds on each rank (RssAnon MiB, sampled every ms; own = the rank's share of the "
              "checkpoint: its weights, its data-parallel part of masters + moments)\n")
        print("| resume, rank | weights: own | load_weights adds | optimizer: own | before load | after prime "
              "| peak during load | after load | adds (peak - before) | transient (peak - after) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for label, r in ours.items():
            for i, k in enumerate(r["ranks"]):
                w, o = k["load_anon"]["load_weights"], k["load_anon"]["load"]
                print(f"| {label.split(' (')[0]}, rank {i} | {k['share']['load_weights']:.0f} | "
                      f"{w['peak'] - w['before']:.0f} | {k['share']['load']:.0f} | {o['before']:.0f} | "
                      f"{k['load_anon'].get('primed', float('nan')):.0f} | {o['peak']:.0f} | {o['after']:.0f} | "
                      f"{o['peak'] - o['before']:.0f} | {o['peak'] - o['after']:.0f} |")
    print()
    for label, r in resumes.items():
        if "deepspeed_load" in r["ranks"][0]["seconds"]:
            secs = ", ".join(f"rank {i}: {k['seconds']['deepspeed_load']:.1f} s ({k['faults']['deepspeed_load']['minor']:,} "
                             f"page faults, {k['faults']['deepspeed_load']['sys']:.1f} s in the kernel; RssAnon "
                             f"{k['deepspeed_anon']['before']:.0f} -> peak {k['deepspeed_anon']['peak']:.0f} -> "
                             f"{k['deepspeed_anon']['after']:.0f} MiB)" for i, k in enumerate(r["ranks"]))
            print(f"{label}: {r['bytes'] / 2**30:.2f} GiB read; {secs}; whole torchrun launch {r['launch']:.1f} s")
            continue
        secs = ", ".join(f"rank {i}: weights {k['seconds'].get('load_weights', 0):.1f} s + optimizer "
                         f"{k['seconds'].get('load', 0):.1f} s{prime_part(k)}" for i, k in enumerate(r["ranks"]))
        print(f"{label}: {secs}; whole torchrun launch {r['launch']:.1f} s")
    if got.get("first_touch"):
        t = got["first_touch"]
        print(f"this machine, no toolkit code: 2 processes at once, each holding {t['held_mib']:,} MiB (the most a rank "
              f"held before its optimizer load), each writing {t['mib']:,} MiB of new anonymous memory (the most an "
              "optimizer-state creation above added) right after the page cache was dropped: " +
              ", ".join(f"{w:.1f} s ({k:.1f} s in the kernel)" for w, k in t["runs"]))


def load_seconds(rank: dict) -> float:
    """Seconds of a rank's load: the runtime's load_weights + load, or DeepSpeed's load_checkpoint."""
    sec = rank["seconds"]
    return sec.get("deepspeed_load", sec.get("load_weights", 0) + sec.get("load", 0))


def prime_part(rank: dict) -> str:
    """The part of the optimizer load that creates the optimizer state (optim_state.prime: the
    moments' memory touched for the first time), with the page faults it took."""
    if "prime" not in rank["seconds"]:
        return ""
    f = rank.get("faults", {}).get("prime", {})
    return (f" (of which {rank['seconds']['prime']:.1f} s create the optimizer state: "
            f"{f.get('minor', 0):,} page faults, {f.get('sys', 0):.1f} s in the kernel)")


def main() -> None:
    if sys.argv[1:2] == ["--rank-main"]:
        mode, out, model, load, sets = sys.argv[2:7]
        rank_main(mode, out, model, load or None, sets)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True, help="scratch folder (DIR/run keeps the trained checkpoint)")
    p.add_argument("--model", default="qwen2-0.5b")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--keep", action="store_true", help="keep the trained checkpoint (DIR/run)")
    p.add_argument("--only", nargs="*", default=None, help="run only the rows whose label contains one of these")
    p.add_argument("--fixed-model", default="llama-tiny",
                   help="model whose conversions measure the fixed cost ('none': skip)")
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    from toolkit.runstate import FORMATS

    rows = [r for r in ROWS if r[2] in FORMATS and (a.only is None or any(o in r[0] for o in a.only))]
    resumes = {k: v for k, v in RESUMES.items() if a.only is None or any(o in k for o in a.only)}
    got = run(a.work, a.model, a.rounds, rows, resumes, None if a.fixed_model == "none" else a.fixed_model)
    (a.work / "results.json").write_text(json.dumps(got, indent=1) + "\n")
    report(got, a.rounds)
    if not a.keep:
        shutil.rmtree(a.work / "run")
        shutil.rmtree(a.work / "fixed_run", ignore_errors=True)


if __name__ == "__main__":
    main()
