"""DeepSpeed ZeRO-3's host-side work per sub-module: what its fetch/release hooks cost the host
on each forward and backward, measured on this machine's CPU (one rank, gloo).

    DS_ACCELERATOR=cpu PYTHONPATH=. python benchmarks/zero3_host_overhead.py [--layers 128] [--width 64] [--steps 30]

A stack of ``--layers`` Linear(width, width) modules, so that the arithmetic is negligible, is run
forward and backward (and stepped) by DeepSpeed's engine at ZeRO-2 and at ZeRO-3 with the bucket
sizes the toolkit's config gives a model of that width (backends.deepspeed.hidden_bucket_sizes);
plain PyTorch is timed beside them. The time inside torch.distributed's collectives (gloo's, on
one rank: copies) is measured apart and taken out. The ZeRO-3 minus ZeRO-2 time of a forward +
backward outside the collectives, divided by the layers, is the host work ZeRO-3 adds per
sub-module and pass pair: on a GPU host this is Python time the GPU waits for whenever a
sub-module's kernels take less. Medians of ``--steps`` steps after 3 warm-up steps, the three
set-ups interleaved step by step.

What this is not: a GPU host's number. DeepSpeed's CPU accelerator runs `numactl --hardware` for
each device_count() (utils/numa.py) unless LOCAL_SIZE is set, which ZeRO-3 asks once per gradient
it reduces; LOCAL_SIZE is set here as the toolkit's runtime sets it (mcore.cpu_compat item 12),
since a CUDA host answers from the driver. Otherwise the CPU accelerator takes the same Python
path through the hooks (partitioned_param_coordinator's fetch_sub_module / release_sub_module),
but its all-gathers are gloo's on one rank here, not NCCL launches; a GPU host's CPU may be
faster or slower than this one. The planner counts it (toolkit.estimate.data_time.ZERO3_HOST_S,
this benchmark's 219 us per bias-free Linear; docs/planner.md, Not done / limits).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def _engine(stage: int, model, width: int):
    import deepspeed

    from toolkit.backends.deepspeed import hidden_bucket_sizes

    b = hidden_bucket_sizes(width)
    zero = {"stage": stage, "overlap_comm": True, "reduce_bucket_size": b["reduce_bucket_size"]}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=b["stage3_prefetch_bucket_size"],
                    stage3_param_persistence_threshold=b["stage3_param_persistence_threshold"])
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": zero,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=128)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--no-bias", action="store_true", help="Linear modules without a bias: one parameter each")
    args = ap.parse_args()
    if os.environ.get("DS_ACCELERATOR") != "cpu":
        print("error: run with DS_ACCELERATOR=cpu (no GPU here)")
        return 2
    # LOCAL_SIZE, as DeepSpeed's launcher and the toolkit's runtime (mcore.cpu_compat item 12) set it: without it
    # DeepSpeed's CPU accelerator runs `numactl --hardware` in every device_count() (utils/numa.py), which ZeRO-3
    # asks once per gradient it reduces, a subprocess per parameter that a CUDA host does not spawn
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE=os.environ.get("LOCAL_SIZE", "1"))
    import torch
    import torch.distributed as td

    in_collectives = [0.0]  # seconds inside torch.distributed's collectives, patched before DeepSpeed reads them

    def timed(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                in_collectives[0] += time.perf_counter() - t0
        return run

    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather", "_all_gather_base",
                 "_reduce_scatter_base", "broadcast", "all_reduce_coalesced", "reduce_scatter"):
        if hasattr(td, name):
            setattr(td, name, timed(getattr(td, name)))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    from toolkit.mcore.cpu_compat import release_deepspeed_shm

    release_deepspeed_shm()  # DeepSpeed's CPU all-reduce segment in /dev/shm, unlinked as the runtime does

    torch.manual_seed(0)
    torch.set_num_threads(1)

    def stack():
        return torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=not args.no_bias)
                                     for _ in range(args.layers)])

    plain = stack()
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-4)
    engines = {"zero2": _engine(2, stack(), args.width), "zero3": _engine(3, stack(), args.width)}
    x = torch.randn(4, args.width)

    def plain_step() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        loss = plain(x).square().mean()
        loss.backward()
        t1 = time.perf_counter()
        plain_opt.step()
        plain_opt.zero_grad()
        return t1 - t0, time.perf_counter() - t1, 0.0

    def engine_step(engine) -> tuple[float, float, float]:
        in_collectives[0] = 0.0
        t0 = time.perf_counter()
        loss = engine(x).square().mean()
        engine.backward(loss)
        t1 = time.perf_counter()
        comm = in_collectives[0]
        engine.step()
        return t1 - t0, time.perf_counter() - t1, comm

    runs = {"torch": plain_step, "zero2": lambda: engine_step(engines["zero2"]),
            "zero3": lambda: engine_step(engines["zero3"])}
    times: dict[str, list[tuple[float, float, float]]] = {k: [] for k in runs}
    for i in range(3 + args.steps):
        for name, run in runs.items():
            t = run()
            if i >= 3:
                times[name].append(t)
    med = {k: tuple(statistics.median(t[i] for t in v) for i in range(3)) for k, v in times.items()}
    host = {k: statistics.median(t[0] - t[2] for t in v) for k, v in times.items()}
    bias = ", bias=False" if args.no_bias else ""
    print(f"{args.layers} x Linear({args.width}, {args.width}{bias}), one rank (gloo), torch {torch.__version__}, "
          f"deepspeed {deepspeed.__version__}, medians of {args.steps} steps:")
    print("| set-up | forward + backward ms | of it in collectives ms | step ms | forward + backward outside the "
          "collectives, us per sub-module |")
    print("|---|---|---|---|---|")
    for name, (fb, st, comm) in med.items():
        print(f"| {name} | {fb * 1e3:.2f} | {comm * 1e3:.2f} | {st * 1e3:.2f} | {host[name] / args.layers * 1e6:.1f} |")
    extra = (host["zero3"] - host["zero2"]) / args.layers
    print(f"ZeRO-3's hooks add {extra * 1e6:.1f} us of host time per sub-module per forward + backward, outside the "
          f"collectives (ZeRO-3 minus ZeRO-2)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
