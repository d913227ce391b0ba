"""Start-up of the command line: whole-process wall time of each command, median over
--repeat interleaved rounds, beside `python -c pass` and `toolkit --help` on the same machine.

    PYTHONPATH=. python benchmarks/startup_bench.py [--repeat 7]

Targets (issue 13): `toolkit plan examples/llama70b_1024gpu.yaml` < 1 s, `toolkit plan SPEC --auto`
for Llama-3.1-405B on 1024 H100 < 2 s, `toolkit convert hf-to-megatron` start-up < 1 s (a
model of a few KB, so the time is the start-up, the conversion of ~100 KB and the exit).
Each round runs every command once, in turn, so the rows share the machine's state.
tests/toolkit/cli/test_startup_imports.py asserts what these times rest on: the planning commands
import neither torch, transformers, deepspeed nor megatron.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from convert_bench import SMALL  # noqa: E402
from plan_search_bench import SPEC as SPEC_405B  # noqa: E402

TINY = dict(SMALL, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, num_hidden_layers=1)
SEED = "examples/llama70b_1024gpu.yaml"


def toolkit() -> list[str]:
    """The installed console script next to this interpreter (what users run), else -m."""
    script = Path(sys.executable).parent / "toolkit"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "toolkit"]


def commands(work: Path) -> list[tuple[str, list[str], float | None]]:
    """(label, argv, target seconds) for each row."""
    import yaml

    spec405 = work / "llama405b_auto.yaml"
    spec405.write_text(yaml.safe_dump(SPEC_405B))
    tk = toolkit()
    return [
        ("python -c pass", [sys.executable, "-c", "pass"], None),
        ("toolkit --help", [*tk, "--help"], None),
        ("toolkit models", [*tk, "models"], None),
        (f"toolkit plan {SEED}", [*tk, "plan", SEED], 1.0),
        (f"toolkit config {SEED} --out DIR", [*tk, "config", SEED, "--out", str(work / "cfg"), "--overwrite"], None),
        ("toolkit plan 405B-on-1024-H100 --auto", [*tk, "plan", str(spec405), "--auto"], 2.0),
        ("toolkit convert hf-to-megatron (tiny)",
         [*tk, "convert", "hf-to-megatron", str(work / "hf"), str(work / "mg"), "--overwrite"], 1.0),
    ]


def wall(argv: list[str]) -> float:
    t = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    took = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr[-2000:]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    work = Path(tempfile.mkdtemp(prefix="startup_bench_"))
    try:
        from converters.synthetic import write_hf_checkpoint  # ROOT is on sys.path (convert_bench puts it)

        write_hf_checkpoint(work / "hf", TINY)
        rows = commands(work)
        times: dict[str, list[float]] = {label: [] for label, _, _ in rows}
        for _ in range(args.repeat):
            for label, argv, _ in rows:
                times[label].append(wall(argv))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(times["python -c pass"])
    print(f"whole-process wall time, median of {args.repeat} interleaved rounds ({os.cpu_count()} cores, "
          f"Python {sys.version.split()[0]})")
    print(f"{'command':52} {'median s':>9} {'min s':>7} {'x python':>9} {'target':>8}")
    for label, _, target in rows:
        med = statistics.median(times[label])
        verdict = "" if target is None else f"< {target:g} s " + ("ok" if med < target else "MISSED")
        print(f"{label:52} {med:9.2f} {min(times[label]):7.2f} {med / base:9.1f} {verdict:>8}")


if __name__ == "__main__":
    main()
