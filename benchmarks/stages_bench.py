"""`hf-to-megatron --stages k`, one command per pipeline stage, against the whole conversion.

    python benchmarks/stages_bench.py [--gb 1] [--pp 4] [--format torch] [--dir /tmp/stages_bench]

A LLaMA-like model of about --gb GB (convert_bench's small shape, random bf16 weights) converted
at tp 1 x pp --pp: once whole, then as --pp separate `toolkit convert ... --stages k` processes,
run one after another here (on a cluster each node runs its own at the same time). Each run is
a whole process, from a warm page cache, timed to exit (wall and CPU seconds, user + system; the
machine is shared, so CPU is the figure to compare). The last stage command also finishes the
folder (renames, fsyncs, the tracker; torch_dist: .metadata from the chunk lists): its wall
minus the median of the others is that cost. Checks that the staged folder holds the same file
names and sizes as the whole one (torch_dist: its .distcp files by their total). Outputs and the
source are deleted at the end.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.convert_bench import env, model_config, toolkit, warm  # noqa: E402
from benchmarks.memory import run_watched  # noqa: E402


def sizes(d: Path) -> dict[str, int]:
    return {str(f.relative_to(d)): f.stat().st_size for f in sorted(d.rglob("*")) if f.is_file()}


def timed(cmd: list[str]) -> tuple[float, float]:
    w = run_watched(cmd, env=env())
    if w.code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({w.code}): {w.stderr[-2000:]}")
    return w.wall, w.cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--format", default="torch", choices=["torch", "torch_dist"])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/stages_bench"))
    a = ap.parse_args()
    what, config = model_config("sizes", int(a.gb))
    config["num_hidden_layers"] = a.pp * max(1, config["num_hidden_layers"] // a.pp)
    a.dir.mkdir(parents=True, exist_ok=True)
    try:
        hf = _hf(a.dir, config)
        flags = ["--tp", "1", "--pp", str(a.pp), "--format", a.format]
        warm(hf)
        whole = timed(toolkit("hf-to-megatron", str(hf), str(a.dir / "whole"), *flags))
        runs = []
        for k in range(a.pp):
            warm(hf)
            runs.append(timed(toolkit("hf-to-megatron", str(hf), str(a.dir / "staged"), *flags, "--stages", str(k))))
        same = _same(sizes(a.dir / "whole"), sizes(a.dir / "staged"))
        gb = sum(sizes(a.dir / "whole").values()) / 1e9
        print(f"{what} ({config['num_hidden_layers']} layers), {gb:.2f} GB written, tp1 pp{a.pp}, {a.format}")
        print(f"whole conversion: {whole[0]:.1f} s wall, {whole[1]:.1f} CPU s")
        for k, (wall, cpu) in enumerate(runs):
            print(f"--stages {k}: {wall:.1f} s wall, {cpu:.1f} CPU s" + (" (finishes the folder)" if k == a.pp - 1
                                                                         else ""))
        rest = statistics.median(w for w, _ in runs[:-1])
        print(f"sum of the stage commands: {sum(w for w, _ in runs):.1f} s wall, {sum(c for _, c in runs):.1f} CPU s; "
              f"the finishing command's extra wall: {runs[-1][0] - rest:+.1f} s; same files as whole: {same}")
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)


def _same(whole: dict[str, int], staged: dict[str, int]) -> bool:
    """Same file names and sizes; torch_dist's .distcp files (one per stage when staged) and
    .metadata (which names them) compared by their total bytes."""
    def kept(fs: dict[str, int]) -> dict[str, int]:
        return {n: v for n, v in fs.items() if not n.endswith((".distcp", ".metadata"))}

    def distcp(fs: dict[str, int]) -> int:
        return sum(v for n, v in fs.items() if n.endswith(".distcp"))

    return kept(whole) == kept(staged) and distcp(whole) == distcp(staged)


def _hf(d: Path, config: dict) -> Path:
    """The HF source only (convert_bench.make_sources also makes Megatron sources)."""
    import json
    import subprocess

    hf = d / "hf"
    if not hf.exists():
        code = "import json,sys; from pathlib import Path; from converters.synthetic import write_hf_checkpoint; " \
               "write_hf_checkpoint(Path(sys.argv[1]), json.loads(sys.argv[2]))"
        subprocess.run([sys.executable, "-c", code, str(hf), json.dumps(config)], check=True, env=env())
    return hf


if __name__ == "__main__":
    main()
