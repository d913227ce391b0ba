"""Compile the DeepSpeed CPU ops the test suite uses, once, before the tests run.

DeepSpeed JIT-compiles its C++ ops on first use (cpu_adam for optimizer offload,
fused_adam for the plain engine optimizer on the CPU accelerator, deepspeed_shm_comm for
collectives). Doing it here keeps minutes of compilation out of individual tests; the
results are cached in torch's extension folder (TORCH_EXTENSIONS_DIR) and reused.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> int:
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, FusedAdamBuilder, ShareMemCommBuilder

    for builder in (CPUAdamBuilder(), FusedAdamBuilder(), ShareMemCommBuilder()):
        start = time.perf_counter()
        builder.load(verbose=False)
        print(f"deepspeed op {builder.NAME}: ready in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
