"""The live bridge (toolkit.bridge) on a >= 1 GB model beside the converters' offline export.

    python benchmarks/bridge_export.py [--gb 1] [--work /tmp/bridge_bench] [--keep]

Model: benchmarks/convert_bench.py's LLaMA-like shape (hidden 2048, GQA 16/4, SwiGLU 5632, vocab
32000) with as many layers as make about --gb GB of random bf16 weights (converters.synthetic).
One torchrun of 4 CPU ranks at tp=2 x pp=2 builds the bf16 model from the HF folder
(toolkit.bridge.plan_for/build_model), load_hf's it, then export_hf(dst=0)'s it (the tensors
dropped as they arrive, as a consumer that forwards them would) and save_hf's it to a folder.
Each rank reports seconds and its peak RSS and RssAnon growth over the phase
(benchmarks/memory.py's PeakMemory), beside
the largest HF tensor (the bound of one gathered tensor). Then the converters' offline export
of the same weights: `toolkit convert megatron-to-hf` of the tp2 pp2 torch_dist checkpoint
hf-to-megatron made from the same HF folder (one process, its peak RSS, timed until the sync).
Prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.convert_bench import env, measure, model_config, toolkit
from benchmarks.memory import PeakMemory

MIB = 1 << 20


class Phase(PeakMemory):
    """PeakMemory (benchmarks/memory.py: the kernel's peak RSS, sampled RssAnon) with the wall time."""

    def __enter__(self):
        self.t0 = time.perf_counter()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.wall = time.perf_counter() - self.t0

    def row(self) -> dict:
        return {"s": self.wall, "growth_mib": self.rss, "anon_mib": self.anon, "rss_mib": self.peak_rss}


def worker(hf: Path, out: Path, result: Path) -> None:
    """One rank of the torchrun: build, load, export, save, each measured."""
    import torch.distributed as dist

    from toolkit import bridge
    from toolkit.mcore import distributed
    from toolkit.parallel.layout import Layout

    distributed.init_parallel(Layout(tp=2, pp=2))
    rows = {}
    with Phase() as m:
        chunks = bridge.build_model(bridge.plan_for(hf, precision="bf16"))
    rows["build"] = m.row()
    with Phase() as m:
        bridge.load_hf(chunks, hf)
    rows["load_hf"] = m.row()
    largest, total = 0, 0
    with Phase() as m:
        for _, t in bridge.export_hf(chunks, hf, dst=0):
            if t is not None:
                largest, total = max(largest, t.nbytes), total + t.nbytes
            del t
    rows["export_hf"] = m.row()
    with Phase() as m:
        bridge.save_hf(chunks, hf, out)
    rows["save_hf"] = m.row()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)
    if dist.get_rank() == 0:
        result.write_text(json.dumps({"ranks": every, "largest_mib": largest / MIB, "total_mib": total / MIB}))
    distributed.destroy()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--work", type=Path, default=Path("/tmp/bridge_bench"))
    p.add_argument("--keep", action="store_true", help="keep the source folders")
    a = p.parse_args()
    label, config = model_config("sizes", a.gb)
    a.work.mkdir(parents=True, exist_ok=True)
    hf, dist_dir = a.work / "hf", a.work / "dist"
    if not hf.exists():
        code = "import json,sys; from pathlib import Path; from converters.synthetic import write_hf_checkpoint; " \
               "write_hf_checkpoint(Path(sys.argv[1]), json.loads(sys.argv[2]))"
        subprocess.run([sys.executable, "-c", code, str(hf), json.dumps(config)], check=True, env=env())
    if not dist_dir.exists():
        subprocess.run(toolkit("hf-to-megatron", str(hf), str(dist_dir), "--tp", "2", "--pp", "2", "--format",
                               "torch_dist"), check=True, env=env(), stdout=subprocess.DEVNULL)
    size = sum(f.stat().st_size for f in hf.glob("*.safetensors")) / MIB
    result, out = a.work / "bridge.json", a.work / "bridge-out"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", __file__,
                    "--worker", str(hf), str(out), str(result)], check=True, env=dict(env(), OMP_NUM_THREADS="1"),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    launch = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    wall, rss, anon, _ = measure(toolkit("megatron-to-hf", str(dist_dir), str(a.work / "conv-out")), dist_dir,
                                       a.work / "conv-out")
    r = json.loads(result.read_text())
    print(f"\n{label}: {size:.0f} MiB of bf16 in the HF folder; largest HF tensor {r['largest_mib']:.0f} MiB; "
          f"exported {r['total_mib']:.0f} MiB\n")
    print("| phase (4 CPU ranks, tp2 pp2) | seconds (max over ranks) | peak RSS growth MiB per rank | peak RssAnon "
          "growth MiB per rank | peak RSS MiB per rank |\n|---|---|---|---|---|")
    for phase in ("build", "load_hf", "export_hf", "save_hf"):
        rows = [rank[phase] for rank in r["ranks"]]
        cells = [" / ".join(f"{x[k]:.0f}" for x in rows) for k in ("growth_mib", "anon_mib", "rss_mib")]
        print(f"| {phase} | {max(x['s'] for x in rows):.1f} | {' | '.join(cells)} |")
    print(f"| (whole torchrun, imports included) | {launch:.1f} | | | |")
    print(f"| converters' megatron-to-hf of the torch_dist tp2 pp2 checkpoint (1 process, offline) | {wall:.1f} | | | "
          f"{rss:.0f} (RssAnon {anon:.0f}) |")
    if not a.keep:
        shutil.rmtree(a.work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
    else:
        main()
