"""hf-to-megatron (tp=2, pp=2, legacy torch format) against the copy floor and a
load-everything baseline, side by side, on synthetic random bf16 checkpoints.

    python benchmarks/convert_bench.py [--sizes 1 4] [--moe] [--repeat 5] [--dir /tmp/convert_bench]

For each model size: ``cp -r`` of the HF folder (the floor: every byte read and written
once), our streaming converter, and a baseline that loads every tensor into memory, builds
every rank's state dict, then saves. Each runs in its own process with a warm page cache,
the three methods in turn in each of --repeat rounds (so that each round's runs share the
machine's state: on a VM, page-cache writes vary several-fold from minute to minute);
wall time is the median over the rounds, peak RSS the child's ru_maxrss. Printed:
time / floor, baseline / ours (time and memory), and RSS growth with model size; then the
same times after start-up (the imports every Python process pays once, a few seconds that
do not grow with the model), measured inside the same runs.
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

SHARD_BYTES = 1 << 30
# LLaMA-like (hidden 2048, GQA 16/4, SwiGLU 5632, vocab 32000): ~90 MB of bf16 per layer.
DENSE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
         "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000,
         "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
         "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
DENSE_LAYERS = {1: 8, 4: 40}  # ~0.98 GB and ~3.9 GB
# Mixtral-like (8 experts, top-2): ~180 MB per layer.
MOE = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 1024,
       "intermediate_size": 3584, "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000,
       "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "hidden_act": "silu",
       "tie_word_embeddings": False, "num_local_experts": 8, "num_experts_per_tok": 2, "torch_dtype": "bfloat16"}
MOE_LAYERS = {2: 12}  # ~2.3 GB


def make_checkpoint(d: Path, config: dict, layers: int) -> int:
    """Random bf16 weights in safetensors shards of <= 1 GB, written tensor by tensor."""
    import torch

    from converters.formats.safetensors_io import header_bytes
    from converters.mapping import ModelMap
    from toolkit.models import shape_from_hf

    cfg = dict(config, num_hidden_layers=layers)
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = list(ModelMap(shape_from_hf(cfg), 0).hf_shapes.items())
    shards, cur, size = [], [], 0
    for name, shape in tensors:
        n = 2 * int(torch.tensor(shape).prod())
        if cur and size + n > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += n
    shards.append(cur)
    weight_map, total, g = {}, 0, torch.Generator().manual_seed(0)
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        with open(d / fname, "wb") as f:
            f.write(header_bytes([(n, s, torch.bfloat16) for n, s in shard]))
            for name, shape in shard:
                t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
                f.write(t.view(-1).view(torch.uint8).numpy().tobytes())
                weight_map[name] = fname
                total += t.numel() * 2
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return total


def start_up(hf_dir: str) -> None:
    """What a process pays once before any byte moves: importing torch and the converters,
    and the transformers config class of the model (loaded lazily on first use)."""
    import converters  # noqa: F401
    import converters.formats.torch_legacy  # noqa: F401
    from toolkit.models import read_hf_config, shape_from_hf

    shape_from_hf(read_hf_config(hf_dir))


def baseline(hf_dir: str, out: str, tp: int, pp: int, ep: int) -> None:
    """Load everything, build every rank's state dict in memory, then torch.save each."""
    import torch
    from safetensors.torch import load_file

    from converters.formats.torch_legacy import rank_dir
    from converters.layout import Layout
    from converters.mapping import ModelMap, to_ranks
    from converters.regions import as_2d
    from toolkit.models import read_hf_config, shape_from_hf
    from toolkit.plan.layout import padded_vocab

    hf = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        hf.update(load_file(f))
    shape = shape_from_hf(read_hf_config(hf_dir))
    mm = ModelMap(shape, padded_vocab(shape.vocab_size, tp))
    files: dict = {}
    for rt, copies in to_ranks(mm, Layout(tp=tp, pp=pp, ep=ep), mm.hf_to_global):
        t = torch.zeros(as_2d(rt.shape), dtype=torch.bfloat16)
        for c in copies:
            src = hf[c.src].reshape(as_2d(tuple(hf[c.src].shape)))
            t[c.dst_row:c.dst_row + c.rows, c.dst_col:c.dst_col + c.cols] = \
                src[c.src_row:c.src_row + c.rows, c.src_col:c.src_col + c.cols]
        files.setdefault((rt.key.tp, rt.key.pp, rt.key.ep), {})[rt.key.name] = t.reshape(rt.shape)
    for (t_, p_, e_), sd in files.items():
        d = Path(out) / "release" / rank_dir(t_, p_, e_, pp, ep)
        d.mkdir(parents=True)
        torch.save({"model": sd}, d / "model_optim_rng.pt")


def ours(hf_dir: str, out: str, tp: int, pp: int, ep: int) -> None:
    import converters

    converters.hf_to_megatron(hf_dir, out, tp=tp, pp=pp, ep=ep)


WORK = "work seconds: "


def measure(cmd: list[str]) -> tuple[float, float, float]:
    """(wall seconds, seconds after start-up, peak RSS in MiB) of one command: wall and RSS
    as GNU time reports them; the second is what a Python method prints after its imports
    (the whole wall time for cp)."""
    subprocess.run(["sync"], check=True)
    r = subprocess.run(["/usr/bin/time", "-f", "%e %M", *cmd], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {r.stderr[-2000:]}")
    wall, kib = r.stderr.strip().splitlines()[-1].split()
    work = [float(line[len(WORK):]) for line in r.stdout.splitlines() if line.startswith(WORK)]
    return float(wall), work[0] if work else float(wall), float(kib) / 1024


def warm(d: Path) -> None:
    """Read every file once, so that each method starts with the source in the page cache."""
    for f in d.iterdir():
        with open(f, "rb") as src, open(os.devnull, "wb") as sink:
            shutil.copyfileobj(src, sink, 1 << 26)


def run_size(work: Path, outs: Path, label: str, config: dict, layers: int, repeat: int, tp: int, pp: int,
             ep: int) -> dict:
    hf = work / f"hf-{label}"
    if not hf.exists():  # in a child process, so this one stays small
        subprocess.run([sys.executable, __file__, "--make", str(hf), json.dumps(config), str(layers)], check=True)
    gb = sum(f.stat().st_size for f in hf.iterdir()) / 1e9
    methods = {
        "cp -r": lambda out: ["cp", "-r", str(hf), str(out)],
        "ours": lambda out: [sys.executable, __file__, "--run", "ours", str(hf), str(out), str(tp), str(pp), str(ep)],
        "baseline": lambda out: [sys.executable, __file__, "--run", "baseline", str(hf), str(out), str(tp), str(pp),
                                 str(ep)],
    }
    row: dict = {"label": label, "gb": gb}
    runs: dict = {name: [] for name in methods}
    for _ in range(repeat):  # methods interleaved, so that each round shares the machine's state
        for name, cmd in methods.items():
            out = outs / f"out-{label}-{name.replace(' ', '')}"
            shutil.rmtree(out, ignore_errors=True)
            warm(hf)
            runs[name].append(measure(cmd(out)))
            shutil.rmtree(out, ignore_errors=True)
    for name, got in runs.items():
        times, works, rss = zip(*got)
        row[name] = (statistics.median(times), max(rss))
        row[name + " work"] = statistics.median(works)
        row[name + " all"] = works
    return row


def report(rows: list[dict]) -> None:
    print(f"\n{'model':>10} {'GB':>6} | {'cp -r s':>8} {'ours s':>8} {'base s':>8} | {'ours/cp':>7} "
          f"{'base/ours':>9} | {'cp MiB':>7} {'ours MiB':>8} {'base MiB':>9} {'base/ours':>9}")
    for r in rows:
        (ct, cm), (ot, om), (bt, bm) = r["cp -r"], r["ours"], r["baseline"]
        print(f"{r['label']:>10} {r['gb']:6.2f} | {ct:8.1f} {ot:8.1f} {bt:8.1f} | {ot / ct:7.2f} {bt / ot:9.2f} | "
              f"{cm:7.0f} {om:8.0f} {bm:9.0f} {bm / om:9.1f}")
    print(f"\nafter start-up (imports of torch, transformers' config class and the converters, paid once per "
          f"process):\n{'model':>10} {'GB':>6} | {'cp -r s':>8} {'ours s':>8} {'base s':>8} | {'ours/cp':>7} "
          f"{'base/ours':>9}")
    for r in rows:
        ct, ot, bt = r["cp -r work"], r["ours work"], r["baseline work"]
        print(f"{r['label']:>10} {r['gb']:6.2f} | {ct:8.1f} {ot:8.1f} {bt:8.1f} | {ot / ct:7.2f} {bt / ot:9.2f}")
    print("\neach round, after start-up (s): cp -r / ours / baseline, and ours/cp")
    for r in rows:
        rounds = zip(r["cp -r all"], r["ours all"], r["baseline all"])
        print(f"{r['label']:>10}: " + "; ".join(f"{c:.2f} / {o:.2f} / {b:.2f} ({o / c:.2f})" for c, o, b in rounds))
    dense = [r for r in rows if r["label"].startswith("dense")]
    if len(dense) == 2:
        a, b = dense
        print(f"\nours peak RSS, {b['gb'] / a['gb']:.1f}x model: {b['ours'][1] / a['ours'][1]:.2f}x "
              f"({a['ours'][1]:.0f} -> {b['ours'][1]:.0f} MiB)")
    print("targets: ours/cp <= 1.5; RSS growth < 1.2x for 4x model; base/ours >= 2 (time) and >= 5 (memory)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="*", default=[1, 4], help="dense model sizes in GB (1 and/or 4)")
    p.add_argument("--moe", action="store_true", help="also a Mixtral-like ~2 GB model (tp=2 pp=2 ep=2)")
    p.add_argument("--repeat", type=int, default=5, help="rounds (each runs every method once)")
    p.add_argument("--dir", type=Path, default=Path("/tmp/convert_bench"), help="where the HF checkpoints are made")
    p.add_argument("--out", type=Path, default=None, help="where outputs go (default: --dir; /dev/shm: no disk)")
    p.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints")
    p.add_argument("--run", nargs=6, help=argparse.SUPPRESS)
    p.add_argument("--make", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.make:
        make_checkpoint(Path(a.make[0]), json.loads(a.make[1]), int(a.make[2]))
        return
    if a.run:
        fn, hf, out, tp, pp, ep = a.run
        start_up(hf)
        t0 = time.perf_counter()
        {"ours": ours, "baseline": baseline}[fn](hf, out, int(tp), int(pp), int(ep))
        print(f"{WORK}{time.perf_counter() - t0:.3f}")
        return
    a.dir.mkdir(parents=True, exist_ok=True)
    outs = a.out or a.dir
    outs.mkdir(parents=True, exist_ok=True)
    rows = [run_size(a.dir, outs, f"dense-{s}GB", DENSE, DENSE_LAYERS[s], a.repeat, 2, 2, 1) for s in a.sizes]
    if a.moe:
        rows.append(run_size(a.dir, outs, "mixtral-2GB", MOE, MOE_LAYERS[2], a.repeat, 2, 2, 2))
    report(rows)
    if not a.keep:
        shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
