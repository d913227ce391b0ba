"""GPU and interconnect registry.

Memory is what `nvidia-smi --query-gpu=memory.total` reports (MiB / 1024 = GiB), not the
marketing number. TFLOP/s are the vendor's dense (no sparsity) tensor-core peaks; FP8 (Hopper's
fourth-generation tensor cores; A100s have none): H100 SXM and H200 1,979, H100 NVL 1,671 (the
datasheets' 3,958 / 3,341 "with sparsity", halved).
Bandwidths are per GPU and per direction, in GB/s (1e9 bytes/s):
  intra-node: NVLink (A100 NVLink3 600 GB/s and H100/H200 NVLink4 900 GB/s bidirectional);
  H100 NVL pairs cards by NVLink bridge (600 GB/s bidirectional, pair only), the rest of a
  node talks over PCIe Gen5 x16 (~64 GB/s), which is what an 8-GPU collective sees.
  inter-node: one InfiniBand NIC per GPU (HDR 200 Gb/s for A100 systems, NDR 400 Gb/s for
  Hopper systems), i.e. 25 and 50 GB/s.
Memory bandwidth (HBM, GB/s, the vendor's datasheet): A100 40GB 1,555 and 80GB 2,039, H100 SXM
3,350, H100 NVL 3,900, H200 4,800, the 96 GB HBM2e H100 2,400 (torchtitan's benchmark page); the step-time model runs memory-bound work (norms,
activation functions, softmax, the optimizer step) at it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import UnknownNameError, closest


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    bf16_tflops: float  # dense; fp16 is the same on these parts
    fp32_tflops: float  # TF32 tensor-core dense peak (what fp32 matmuls use in torch with TF32 on)
    intra_node_gbps: float
    inter_node_gbps: float
    memory_gbps: float  # HBM bandwidth
    arch: str = "hopper"  # the generation (the step-time model's GEMM efficiency is per generation)
    fp8_tflops: float = 0.0  # dense FP8 tensor-core peak; 0: no FP8 tensor cores (Ampere and older)

    def peak_tflops(self, precision: str) -> float:
        if precision == "fp8":
            return self.fp8_tflops
        return self.fp32_tflops if precision == "fp32" else self.bf16_tflops


GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU("a100-40gb", 40960 / 1024, 312.0, 156.0, 300.0, 25.0, 1555.0, "ampere"),
        GPU("a100-80gb", 81920 / 1024, 312.0, 156.0, 300.0, 25.0, 2039.0, "ampere"),
        # Jean Zay's A100 80GB nodes (IDRIS), where BigScience trained BLOOM: 8 GPUs on NVLink and 4 Omni-Path
        # links of 100 Gb/s a node (bigscience-workshop/bigscience train/tr11-176B-ml/README.md, "Hardware"), so
        # 50 Gb/s = 6.25 GB/s a GPU between nodes, a quarter of a DGX A100's one HDR NIC a GPU.
        GPU("a100-80gb-opa", 81920 / 1024, 312.0, 156.0, 300.0, 6.25, 2039.0, "ampere"),
        GPU("h100-80gb", 81559 / 1024, 989.0, 494.0, 450.0, 50.0, 3350.0, fp8_tflops=1979.0),
        GPU("h100-nvl-94gb", 95830 / 1024, 835.0, 418.0, 64.0, 50.0, 3900.0, fp8_tflops=1671.0),
        GPU("h200-141gb", 143771 / 1024, 989.0, 494.0, 450.0, 50.0, 4800.0, fp8_tflops=1979.0),
        # Meta's Grand Teton H100 (torchtitan's benchmarks/llama3_h100_202412_torchtitan.md): 96 GB HBM2e at
        # 2.4 TB/s, 500 W power limit, 400 Gb/s RDMA per GPU. Its memory is the marketing 96 GB (no nvidia-smi
        # figure is published); its peak is "between SXM and NVL" (835-989) and unknown: SXM's, as torchtitan's
        # own MFU figures use, so an estimate on it is an upper bound by up to 989/835 = 1.18x.
        GPU("h100-96gb-hbm2e", 96e9 / 1024**3, 989.0, 494.0, 450.0, 50.0, 2400.0, fp8_tflops=1979.0),
        # CPU ranks (tests, laptops): host memory is the limit; FLOP/s and bandwidths are nominal.
        GPU("cpu", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3, 1.0, 1.0, 10.0, 1.0, 20.0),
    )
}
ALIASES = {"h100": "h100-80gb", "h100-sxm": "h100-80gb", "h200": "h200-141gb", "a100": "a100-80gb"}


def get_gpu(name: str) -> GPU:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        hint = closest(name, list(GPUS))
        raise UnknownNameError(
            f"unknown gpu '{name}'" + (f" (did you mean '{hint}'?)" if hint else "")
            + f"; known: {', '.join(GPUS)}"
        )
    return GPUS[key]
