"""Conversion against ``cp -r`` of the same bytes, every direction and format, whole process.

    python benchmarks/convert_bench.py [--layers 32 16] [--repeat 3] [--shm /dev/shm/convert_bench]
    python benchmarks/convert_bench.py --layers 4 --repeat 1 --out /dev/shm/cb --no-reshard   # output on tmpfs
    python benchmarks/convert_bench.py --layers 4 --unit-costs --shm /dev/shm/cb    # CPU s/GB per kind of work
    python benchmarks/convert_bench.py --sizes 1 4 --repeat 3        # small LLaMA-like models instead

Models: random bf16 weights of Llama-3-8B's real shapes (hidden 4096, 32 heads / 8 KV heads,
SwiGLU 14336, vocab 128256) with --layers layers (32: 16.06 GB; 16: 9.08 GB; 4: 3.85 GB), or
with --sizes, a small LLaMA-like shape (hidden 2048) of about that many GB. For the first
model every row runs once per ``--workers`` count (default 1 and 2) for --repeat rounds,
rows in turn and in each row ``cp -r`` of the row's source folder right before ours (the
page cache is filled from the source first, the other sources dropped from it, and dirty
pages flushed), its output in --out (default --dir). Each run is a separate ``python -m
toolkit convert ...`` process, printed side by side with its ``cp -r``: seconds to exit and
to exit plus the ``sync`` after it (to the disk), CPU seconds (user + system, workers
included; the fair comparison on a shared machine), peak RSS (the kernel's, plus each
worker process's) and the peak of anonymous memory (RssAnon, sampled every 5 ms from
outside, workers included), with the load average. Medians over the rounds, and each
side's least CPU over the rounds (on a shared or virtual machine noise only adds: reclaim,
host page faults); MB/s = weight bytes written / wall to the disk. The other models run
every row once, for peak memory against model size. With --shm, the last model's rows run
again with their output on that (other) filesystem. Then start-up: seconds from spawn
to the first weight byte read, beside ``python -c pass`` and ``toolkit --help``.
``--unit-costs`` instead prints the CPU seconds per GB of each kind of work on a tensor's
bytes (kernel copy, pwritev from a map, CRC-32, a dim-1 gather, FP8 dequantisation) beside
``cp`` of the same file, in one process, --repeat rounds in turn (--unit-gb GB of the
largest HF shard): the costs docs/converters.md plans a 671B conversion from, and the
per-byte comparison with ``cp`` that whole-process runs on a noisy machine cannot make.
Sources and outputs are deleted at the end (--keep keeps the sources).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.memory import run_watched  # noqa: E402

SMALL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
         "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000,
         "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
         "tie_word_embeddings": False, "torch_dtype": "bfloat16"}  # ~90 MB of bf16 per layer
LAYOUT = ["--tp", "2", "--pp", "2"]
# (label, source folder: hf | torch | dist, arguments after `toolkit convert`, with OUT for the output)
ROWS = [
    ("hf-to-megatron -> torch, tp2 pp2", "hf", ["hf-to-megatron", "SRC", "OUT", *LAYOUT]),
    ("hf-to-megatron -> torch_dist, tp2 pp2", "hf", ["hf-to-megatron", "SRC", "OUT", *LAYOUT, "--format", "torch_dist"]),
    ("megatron-to-hf <- torch tp2 pp2", "torch", ["megatron-to-hf", "SRC", "OUT"]),
    ("megatron-to-hf <- torch_dist", "dist", ["megatron-to-hf", "SRC", "OUT"]),
    ("megatron-to-megatron torch tp2 pp2 -> tp4 pp1", "torch", ["megatron-to-megatron", "SRC", "OUT", "--tp", "4",
                                                                "--pp", "1"]),
    ("megatron-to-megatron torch_dist -> torch_dist tp1 pp1", "dist", ["megatron-to-megatron", "SRC", "OUT", "--tp",
                                                                      "1", "--pp", "1"]),
]


def model_config(kind: str, n: int) -> tuple[str, dict]:
    from toolkit.models import named_models

    if kind == "layers":
        return f"Llama-3-8B shape, {n} layers", dict(named_models()["llama3-8b"]["config"], num_hidden_layers=n)
    layers = max(4, 4 * round((n * 1e9 - 2 * 32000 * 2048 * 2) / 90.2e6 / 4))  # pp=2 stages, even
    return f"LLaMA-like hidden 2048, {layers} layers", dict(SMALL, num_hidden_layers=layers)


def toolkit(*args: str) -> list[str]:
    return [sys.executable, "-m", "toolkit", "convert", *args]


def env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")


def make_sources(d: Path, config: dict) -> dict[str, Path]:
    """HF folder (random weights), and our legacy and torch_dist conversions of it at tp2 pp2."""
    src = {"hf": d / "hf", "torch": d / "torch", "dist": d / "dist"}
    if not src["hf"].exists():
        code = "import json,sys; from pathlib import Path; from converters.synthetic import write_hf_checkpoint; " \
               "write_hf_checkpoint(Path(sys.argv[1]), json.loads(sys.argv[2]))"
        subprocess.run([sys.executable, "-c", code, str(src["hf"]), json.dumps(config)], check=True, env=env())
    for kind, fmt in (("torch", "torch"), ("dist", "torch_dist")):
        if not src[kind].exists():
            subprocess.run(toolkit("hf-to-megatron", str(src["hf"]), str(src[kind]), *LAYOUT, "--format", fmt),
                           check=True, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return src


def size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def evict(d: Path) -> None:
    """Drop ``d``'s clean pages from the page cache (POSIX_FADV_DONTNEED; no root needed)."""
    for f in d.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def warm(d: Path) -> None:
    """Every source byte read once (so each run starts from the page cache), then sync. The
    other sources of the run (siblings of ``d``) are dropped from the cache first: a copy
    onto tmpfs needs free memory for its output, and where the sources fill the cache the
    kernel reclaims pages in the copying process's own context, a cost that changed `cp -r`'s
    CPU 2-3x from row to row on a 23 GB machine with three 9 GB sources."""
    if d.is_dir():
        for other in d.parent.iterdir():
            if other.is_dir() and other != d:
                evict(other)
    for f in [d] if d.is_file() else d.rglob("*"):
        if f.is_file():
            with open(f, "rb") as src, open(os.devnull, "wb") as sink:
                shutil.copyfileobj(src, sink, 1 << 26)
    subprocess.run(["sync"], check=True)


def free_gb() -> float:
    """MemFree in GB: room for a tmpfs output without reclaiming the page cache."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemFree:")) / 2**20


def timed_sync() -> float:
    """Seconds `sync` takes: flushing what the last run left in the page cache."""
    start = time.perf_counter()
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - start


@dataclass
class Run:
    """One run: seconds to exit, seconds of the `sync` after it, CPU seconds (user + system,
    the process and the workers it waited for), peak RSS and RssAnon (MiB), bytes written."""
    exit: float
    sync: float
    cpu: float
    rss: float
    anon: float
    written: int

    @property
    def synced(self) -> float:
        return self.exit + self.sync


def run_once(cmd: list[str], src: Path, out: Path) -> Run:
    """One run from a warm page cache, then `sync` timed apart; output removed."""
    shutil.rmtree(out, ignore_errors=True)
    warm(src)
    w = run_watched(cmd, env=env())
    if w.code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({w.code}): {w.stderr[-2000:]}")
    flushed = timed_sync()
    written = size(out)
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    return Run(w.wall, flushed, w.cpu, w.rss, w.anon, written)


def measure(cmd: list[str], src: Path, out: Path) -> tuple[float, float, float, int]:
    """(seconds, peak RSS MiB, peak RssAnon MiB, bytes written) of one run, timed until its
    bytes are on the disk: to exit plus the `sync` after it (a conversion fsyncs its output
    before renaming it into place; `cp` leaves the flush to `sync`); output removed."""
    r = run_once(cmd, src, out)
    return r.synced, r.rss, r.anon, r.written


def with_workers(rows, workers: list[int]):
    """Each row once per worker count (``--workers N`` added where N > 1)."""
    return [(label if n == 1 else f"{label}, --workers {n}", kind, args if n == 1 else [*args, "--workers", str(n)])
            for label, kind, args in rows for n in workers]


def run_rows(src: dict[str, Path], outs: Path, rows, repeat: int, with_cp: bool) -> dict:
    """label -> {"cp": [Run], "ours": [Run]}, rows interleaved per round; ``cp -r`` of the
    row's source folder right before each of ours (the same page-cache state)."""
    got: dict = {label: {"cp": [], "ours": []} for label, _, _ in rows}
    for _ in range(repeat):
        for label, kind, args in rows:
            out = outs / "out"
            if with_cp:
                got[label]["cp"].append(run_once(["cp", "-r", str(src[kind]), str(out)], src[kind], out))
            cmd = toolkit(*[str(src[kind]) if a == "SRC" else str(out) if a == "OUT" else a for a in args])
            got[label]["ours"].append(run_once(cmd, src[kind], out))
            o = got[label]["ours"][-1]
            cp = got[label]["cp"][-1] if with_cp else None
            cp_s = f"cp -r {cp.exit:.1f}+{cp.sync:.1f} s (CPU {cp.cpu:.1f}), " if cp else ""
            print(f"  {label}: {cp_s}ours {o.exit:.1f}+{o.sync:.1f} s (CPU {o.cpu:.1f}), RSS {o.rss:.0f} MiB, "
                  f"RssAnon {o.anon:.0f} MiB  [load {load()}, {free_gb():.1f} GB free]", file=sys.stderr, flush=True)
    return got


def load() -> str:
    """The 1-minute load average (other work on the machine skews every wall time)."""
    return f"{os.getloadavg()[0]:.1f}"


def _med(runs: list[Run], f) -> float:
    return statistics.median(f(r) for r in runs) if runs else float("nan")


def medians(r: dict) -> tuple[float, float, float, float, float]:
    """(cp s, ours s, peak RSS MiB, peak anon MiB, MB/s), timed to the disk: medians of time,
    maxima of memory."""
    ours = r["ours"]
    return (_med(r["cp"], lambda x: x.synced), _med(ours, lambda x: x.synced), max(x.rss for x in ours),
            max(x.anon for x in ours), _med(ours, lambda x: x.written / x.synced / 1e6))


def table(title: str, got: dict) -> None:
    """Side by side: to exit (no sync) and to the disk (+ sync), CPU seconds, memory; the
    ratios are of medians of the same rounds (cp -r right before ours)."""
    print(f"\n{title}\n\n| direction / format | cp -r s exit / +sync | ours s exit / +sync | ours/cp exit | "
          "ours/cp +sync | CPU s cp / ours | CPU ours/cp | CPU s cp / ours, min | CPU ours/cp, min | MB/s +sync | "
          "peak RSS MiB | peak RssAnon MiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, r in got.items():
        cp, ours = r["cp"], r["ours"]
        o_exit, o_sync, o_cpu = _med(ours, lambda x: x.exit), _med(ours, lambda x: x.synced), _med(ours, lambda x: x.cpu)
        _, _, rss, anon, mbs = medians(r)
        if cp:
            c_exit, c_sync, c_cpu = _med(cp, lambda x: x.exit), _med(cp, lambda x: x.synced), _med(cp, lambda x: x.cpu)
            c_min, o_min = min(x.cpu for x in cp), min(x.cpu for x in ours)
            cols = (f"{c_exit:.1f} / {c_sync:.1f}", f"{o_exit / c_exit:.2f}", f"{o_sync / c_sync:.2f}",
                    f"{c_cpu:.1f} / {o_cpu:.1f}", f"{o_cpu / c_cpu:.2f}", f"{c_min:.1f} / {o_min:.1f}",
                    f"{o_min / c_min:.2f}")
        else:
            o_min = min(x.cpu for x in ours)
            cols = ("-", "-", "-", f"- / {o_cpu:.1f}", "-", f"- / {o_min:.1f}", "-")
        print(f"| {label} | {cols[0]} | {o_exit:.1f} / {o_sync:.1f} | {cols[1]} | {cols[2]} | {cols[3]} | {cols[4]} | "
              f"{cols[5]} | {cols[6]} | {mbs:.0f} | {rss:.0f} | {anon:.0f} |")
    if any(r["cp"] for r in got.values()):
        print("\neach round, CPU s cp -> ours (the spread of `cp -r`'s own CPU is this machine's noise): " + "; ".join(
            f"{label} " + " ".join(f"{c.cpu:.1f}->{o.cpu:.1f}" for c, o in zip(r["cp"], r["ours"]))
            for label, r in got.items() if r["cp"]))
        print("\neach round, ours/cp to exit: " + "; ".join(
            f"{label} " + " ".join(f"{o.exit / c.exit:.2f}" for c, o in zip(r["cp"], r["ours"]))
            for label, r in got.items() if r["cp"]))


def compare_rss(big: tuple[str, dict], small: tuple[str, dict]) -> None:
    print(f"\npeak memory against model size: {big[0]} vs {small[0]}\n\n"
          "| direction / format | peak RSS MiB | change | peak RssAnon MiB | change |\n|---|---|---|---|---|")
    for label in small[1]:
        _, _, rb, ab, _ = medians(big[1][label])
        _, _, rs, as_, _ = medians(small[1][label])
        print(f"| {label} | {rs:.0f} -> {rb:.0f} | {100 * (rb / rs - 1):+.1f}% | {as_:.0f} -> {ab:.0f} | "
              f"{100 * (ab / as_ - 1):+.1f}% |")


def first_byte(hf: Path, outs: Path, fmt: str) -> float:
    """Seconds from spawn to the first weight byte read by `toolkit convert hf-to-megatron`."""
    code = ("import os, sys, time\nfrom converters import files\n"
            "def first(*a):\n    print(time.time(), flush=True)\n    os._exit(0)\n"
            "files.FileTensors.window = files.FileTensors.extent = first\n"
            "from toolkit.cli import main\nmain(sys.argv[1:])\n")
    shutil.rmtree(outs / "startup", ignore_errors=True)
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", code, "convert", "hf-to-megatron", str(hf), str(outs / "startup"),
                        *LAYOUT, "--format", fmt], capture_output=True, text=True, env=env())
    t = float(r.stdout.strip().splitlines()[-1]) - t0
    shutil.rmtree(outs / "startup", ignore_errors=True)
    return t


def startup(hf: Path, outs: Path, repeat: int = 7) -> None:
    def wall(cmd):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, env=env(), capture_output=True)
        return time.perf_counter() - t0

    rows = {"python -c pass": lambda: wall([sys.executable, "-c", "pass"]),
            "toolkit --help": lambda: wall([sys.executable, "-m", "toolkit", "--help"]),
            "hf-to-megatron (torch): spawn to first byte read": lambda: first_byte(hf, outs, "torch"),
            "hf-to-megatron (torch_dist): spawn to first byte read": lambda: first_byte(hf, outs, "torch_dist")}
    times = {k: [] for k in rows}
    for _ in range(repeat):
        for k, fn in rows.items():
            times[k].append(fn())
    print(f"\nstart-up, median of {repeat} (s)\n\n| what | s |\n|---|---|")
    for k, v in times.items():
        print(f"| {k} | {statistics.median(v):.2f} |")


def _cpu() -> float:
    """CPU seconds of this process and of its waited-for children (``cp``)."""
    import resource

    r, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime


def unit_costs(src: Path, outs: Path, shm: Path | None, gb: float = 1.0, rounds: int = 1) -> None:
    """CPU seconds per GB of each kind of work a conversion does with a tensor's bytes, on
    ``gb`` GB of ``src`` (a page-cached safetensors file), in this process: the costs a
    large conversion is planned from (docs/converters.md). Each a 16 MiB chunk at a time, as
    the converters stream (converters.stream.CHUNK_BYTES), beside ``cp`` of the whole file
    onto the same filesystem; ``rounds`` times in turn, least and median."""
    import mmap

    import numpy as np
    import torch

    from converters.fp8 import dequantize_rows
    from converters.sink import KernelCopy, pwritev_all
    from converters.stream import CHUNK_BYTES

    try:
        from isal.isal_zlib import crc32
    except ImportError:
        from zlib import crc32
    from toolkit.cli.convert import one_torch_thread

    one_torch_thread()  # as `toolkit convert` runs
    n = min(int(gb * 1e9), src.stat().st_size) // CHUNK_BYTES * CHUNK_BYTES
    fd = os.open(src, os.O_RDONLY)
    warm(src)

    def mapped(off: int):
        return mmap.mmap(fd, CHUNK_BYTES, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                         prot=mmap.PROT_READ, offset=off)

    def kernel(where: Path):
        out = os.open(where / "unit", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        copy = KernelCopy()
        ok = copy._copy((fd, 0), out, 0, CHUNK_BYTES)
        for off in range(CHUNK_BYTES if ok else n, n, CHUNK_BYTES):
            copy._copy((fd, off), out, off, CHUNK_BYTES)
        os.close(out)
        return ok

    def pwrite_map(where: Path):
        out = os.open(where / "unit", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for off in range(0, n, CHUNK_BYTES):
            m = mapped(off)
            pwritev_all(out, [memoryview(m)], off)
            m.close()
        os.close(out)

    def cp(where: Path):
        subprocess.run(["cp", str(src), str(where / "unit")], check=True)

    def pwrite_map_crc(where: Path):  # what a legacy torch record costs: CRC-32, then the write
        out = os.open(where / "unit", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for off in range(0, n, CHUNK_BYTES):
            m = mapped(off)
            crc32(m)
            pwritev_all(out, [memoryview(m)], off)
            m.close()
        os.close(out)

    def checksum(_):
        for off in range(0, n, CHUNK_BYTES):
            m = mapped(off)
            crc32(m)
            m.close()

    def gather(_):  # the left half of each row of a [rows, 4096] bf16 block: a dim-1 shard
        buf = np.empty((CHUNK_BYTES // 8192, 4096), dtype=np.uint8)
        for off in range(0, n, CHUNK_BYTES):
            m = mapped(off)
            buf[:] = np.frombuffer(m, dtype=np.uint8).reshape(-1, 8192)[:, :4096]
            m.close()

    def dequant(_):  # FP8 [rows, 7168] with 128x128 scales -> bf16, per GB of bf16 written
        rows = CHUNK_BYTES // 2 // 7168 // 128 * 128
        w = torch.randint(0, 0x7E, (rows, 7168), dtype=torch.uint8).view(torch.float8_e4m3fn)
        scale = torch.rand(rows // 128, 56)
        for _ in range(n // (rows * 7168 * 2)):
            dequantize_rows(w, scale, 0, (128, 128), torch.bfloat16)

    print(f"\nCPU seconds per GB, {n / 1e9:.2f} GB of {src.name} in 16 MiB chunks, {rounds} rounds in turn "
          f"(load {load()})\n\n| work | CPU s/GB, least | median | GB/s per core |\n|---|---|---|---|")
    steps = [(f"`cp` of the whole file ({src.stat().st_size / 1e9:.2f} GB) onto {shm or outs}", cp, shm or outs),
             ("kernel copy_file_range, same filesystem (" + str(outs) + ")", kernel, outs),
             ("pwritev from a map (" + str(shm or outs) + ")", pwrite_map, shm or outs),
             ("CRC-32, then pwritev from the map (" + str(shm or outs) + ")", pwrite_map_crc, shm or outs),
             ("CRC-32 of mapped bytes (ISA-L; legacy torch records)", checksum, None),
             ("gather a dim-1 half from mapped rows (numpy)", gather, None),
             ("FP8 128x128-block dequantise to bf16 (torch), per GB out", dequant, None)]
    costs: dict[str, list[float]] = {label: [] for label, _, _ in steps}
    refused: set[str] = set()
    for _ in range(rounds):
        for label, fn, where in steps:
            if where is not None:
                where.mkdir(parents=True, exist_ok=True)
            t0 = _cpu()
            if fn(where) is False:
                refused.add(label)
            costs[label].append((_cpu() - t0) / ((src.stat().st_size if fn is cp else n) / 1e9))
            if where is not None:
                (where / "unit").unlink(missing_ok=True)
    for label, _, _ in steps:
        least, med = min(costs[label]), statistics.median(costs[label])
        shown = label + (": refused (another filesystem)" if label in refused else "")
        print(f"| {shown} | {least:.3f} | {med:.3f} | {1 / med if med else float('inf'):.2f} |", flush=True)
    os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="*", default=[32, 16], help="Llama-3-8B shape with these layers")
    p.add_argument("--sizes", type=int, nargs="*", help="instead: small LLaMA-like models of about these GB")
    p.add_argument("--repeat", type=int, default=3, help="rounds for the first model")
    p.add_argument("--dir", type=Path, default=Path("/tmp/convert_bench"), help="sources and outputs")
    p.add_argument("--shm", type=Path, default=None, help="also: the last model's rows with output here")
    p.add_argument("--keep", action="store_true", help="keep the sources")
    p.add_argument("--out", type=Path, default=None, help="the first model's outputs here (default: --dir)")
    p.add_argument("--workers", type=int, nargs="*", default=[1, 2], help="each row with these --workers")
    p.add_argument("--no-reshard", action="store_true", help="leave out the megatron-to-megatron rows")
    p.add_argument("--no-startup", action="store_true", help="leave out the start-up table")
    p.add_argument("--unit-costs", action="store_true", help="only: CPU s/GB of each kind of work (first model)")
    p.add_argument("--unit-gb", type=float, default=1.0, help="with --unit-costs: GB of the file to work on")
    a = p.parse_args()
    models = [model_config("sizes", n) for n in a.sizes] if a.sizes else [model_config("layers", n) for n in a.layers]
    base = ROWS[:4] if a.no_reshard else ROWS
    print(f"load average at start: {os.getloadavg()} ({os.cpu_count()} CPUs)", flush=True)
    results = []
    for i, (name, config) in enumerate(models):
        d = a.dir / f"m{i}"
        src = make_sources(d, config)
        gb = size(src["hf"]) / 1e9
        if a.unit_costs:
            unit_costs(max(src["hf"].glob("*.safetensors"), key=lambda f: f.stat().st_size), a.dir, a.shm,
                       gb=a.unit_gb, rounds=a.repeat)
            return
        outs = (a.out or a.dir) if i == 0 else a.dir
        outs.mkdir(parents=True, exist_ok=True)
        rows = with_workers(base, a.workers) if i == 0 else base
        got = run_rows(src, outs, rows, a.repeat if i == 0 else 1, with_cp=i == 0)
        table(f"{name}, {gb:.2f} GB, output on {outs} ({'median of %d rounds' % a.repeat if i == 0 else 'one run'}"
              f"), load average after: {load()}", got)
        results.append((f"{name} ({gb:.2f} GB)", got))
        if i == 0 and not a.no_startup:
            startup(src["hf"], a.dir)
        if i == len(models) - 1 and a.shm:
            a.shm.mkdir(parents=True, exist_ok=True)
            table(f"{name}, {gb:.2f} GB, output on {a.shm} (median of {a.repeat} rounds)",
                  run_rows(src, a.shm, base, a.repeat, with_cp=True))
            shutil.rmtree(a.shm, ignore_errors=True)
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)
    for small in results[1:]:
        compare_rss(results[0], small)


if __name__ == "__main__":
    main()
