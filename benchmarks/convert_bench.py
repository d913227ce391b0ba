"""Conversion against ``cp -r`` of the same bytes, every direction and format, whole process.

    python benchmarks/convert_bench.py [--layers 32 16] [--repeat 3] [--shm /dev/shm/convert_bench]
    python benchmarks/convert_bench.py --sizes 1 4 --repeat 3        # small LLaMA-like models instead

Models: random bf16 weights of Llama-3-8B's real shapes (hidden 4096, 32 heads / 8 KV heads,
SwiGLU 14336, vocab 128256) with --layers layers (32: 16.06 GB; 16: 9.08 GB), or with
--sizes, a small LLaMA-like shape (hidden 2048) of about that many GB. For the first model
every row runs --repeat rounds, rows in turn and in each row ``cp -r`` of the row's source
folder then ours (runs of a round share the machine's state; the page cache is filled from
the source first and dirty pages flushed). Each run is a separate ``python -m toolkit
convert ...`` process: seconds to exit plus the ``sync`` after it (both sides timed until
their bytes are on the disk), its peak RSS (the kernel's, plus each worker
process's), and the peak of its anonymous memory (RssAnon, sampled every 5 ms from outside,
workers included). Medians over the rounds; MB/s = weight bytes written / wall. The other
models run every row once, for peak memory against model size. With --shm, the last model's
rows run again with their output on that (other) filesystem. Then start-up: seconds from
spawn to the first weight byte read, beside ``python -c pass`` and ``toolkit --help``.
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
WORKER_ROWS = [(label + ", --workers 2", src, [*args, "--workers", "2"]) for label, src, args in (ROWS[0], ROWS[3])]


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


def warm(d: Path) -> None:
    """Every source byte read once (so each run starts from the page cache), then sync."""
    for f in d.rglob("*"):
        if f.is_file():
            with open(f, "rb") as src, open(os.devnull, "wb") as sink:
                shutil.copyfileobj(src, sink, 1 << 26)
    subprocess.run(["sync"], check=True)


def timed_sync() -> float:
    """Seconds `sync` takes: flushing what the last run left in the page cache."""
    start = time.perf_counter()
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - start


def measure(cmd: list[str], src: Path, out: Path) -> tuple[float, float, float, int]:
    """(seconds, peak RSS MiB, peak RssAnon MiB, bytes written) of one run, timed until its
    bytes are on the disk: to exit plus the `sync` after it (a conversion fsyncs its output
    before renaming it into place; `cp` leaves the flush to `sync`); output removed."""
    shutil.rmtree(out, ignore_errors=True)
    warm(src)
    w = run_watched(cmd, env=env())
    if w.code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({w.code}): {w.stderr[-2000:]}")
    flushed = timed_sync()
    written = size(out)
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    return w.wall + flushed, w.rss, w.anon, written


def run_rows(src: dict[str, Path], outs: Path, rows, repeat: int, with_cp: bool) -> dict:
    """label -> {"cp": [walls], "ours": [(wall, rss, anon, bytes)]}, rows interleaved per round."""
    got: dict = {label: {"cp": [], "ours": []} for label, _, _ in rows}
    for _ in range(repeat):
        for label, kind, args in rows:
            out = outs / "out"
            if with_cp:
                got[label]["cp"].append(measure(["cp", "-r", str(src[kind]), str(out)], src[kind], out)[0])
            cmd = toolkit(*[str(src[kind]) if a == "SRC" else str(out) if a == "OUT" else a for a in args])
            got[label]["ours"].append(measure(cmd, src[kind], out))
            w, rss, anon, _ = got[label]["ours"][-1]
            cp = f"cp -r {got[label]['cp'][-1]:.1f} s, " if with_cp else ""
            print(f"  {label}: {cp}ours {w:.1f} s, RSS {rss:.0f} MiB, RssAnon {anon:.0f} MiB", file=sys.stderr,
                  flush=True)
    return got


def medians(r: dict) -> tuple[float, float, float, float, float]:
    """(cp s, ours s, peak RSS MiB, peak anon MiB, MB/s): medians of time, maxima of memory."""
    walls = [w for w, _, _, _ in r["ours"]]
    cp = statistics.median(r["cp"]) if r["cp"] else float("nan")  # no cp -r in the row: printed as "-"
    ours = statistics.median(walls)
    mbs = statistics.median(b / w / 1e6 for w, _, _, b in r["ours"])
    return cp, ours, max(x[1] for x in r["ours"]), max(x[2] for x in r["ours"]), mbs


def table(title: str, got: dict) -> None:
    print(f"\n{title}\n\n| direction / format | cp -r s | ours s | wall / cp | MB/s | peak RSS MiB | peak RssAnon MiB |"
          "\n|---|---|---|---|---|---|---|")
    for label, r in got.items():
        cp, ours, rss, anon, mbs = medians(r)
        ratio, cp_s = (f"{ours / cp:.2f}", f"{cp:.1f}") if r["cp"] else ("-", "-")
        print(f"| {label} | {cp_s} | {ours:.1f} | {ratio} | {mbs:.0f} | {rss:.0f} | {anon:.0f} |")
    if any(r["cp"] for r in got.values()):
        print("\neach round, ours/cp: " + "; ".join(
            f"{label} " + " ".join(f"{o[0] / c:.2f}" for c, o in zip(r["cp"], r["ours"]))
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="*", default=[32, 16], help="Llama-3-8B shape with these layers")
    p.add_argument("--sizes", type=int, nargs="*", help="instead: small LLaMA-like models of about these GB")
    p.add_argument("--repeat", type=int, default=3, help="rounds for the first model")
    p.add_argument("--dir", type=Path, default=Path("/tmp/convert_bench"), help="sources and outputs")
    p.add_argument("--shm", type=Path, default=None, help="also: the last model's rows with output here")
    p.add_argument("--keep", action="store_true", help="keep the sources")
    a = p.parse_args()
    models = [model_config("sizes", n) for n in a.sizes] if a.sizes else [model_config("layers", n) for n in a.layers]
    results = []
    for i, (name, config) in enumerate(models):
        d = a.dir / f"m{i}"
        src = make_sources(d, config)
        gb = size(src["hf"]) / 1e9
        rows = ROWS + WORKER_ROWS if i == 0 else ROWS
        got = run_rows(src, a.dir, rows, a.repeat if i == 0 else 1, with_cp=i == 0)
        table(f"{name}, {gb:.2f} GB, output on {a.dir} ({'median of %d rounds' % a.repeat if i == 0 else 'one run'})",
              got)
        results.append((f"{name} ({gb:.2f} GB)", got))
        if i == 0:
            startup(src["hf"], a.dir)
        if i == len(models) - 1 and a.shm:
            a.shm.mkdir(parents=True, exist_ok=True)
            table(f"{name}, {gb:.2f} GB, output on {a.shm} (median of {a.repeat} rounds)",
                  run_rows(src, a.shm, ROWS, a.repeat, with_cp=True))
            shutil.rmtree(a.shm, ignore_errors=True)
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)
    for small in results[1:]:
        compare_rss(results[0], small)


if __name__ == "__main__":
    main()
