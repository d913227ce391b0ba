"""DeepSpeed's CPU ops that the test suite uses (cpu_adam, fused_adam, deepspeed_shm_comm),
built once per machine and reused by every checkout: `python tools/build_ds_ops.py`.

DeepSpeed JIT-compiles an op on first use into ~/.cache/torch_extensions, keyed by the op's
sources and include paths; a new checkout has a new .venv, so those paths change and torch
compiles again (about 5 minutes of one core's time). Here the ops are compiled ahead of time
into a DeepSpeed wheel (`DS_BUILD_<OP>=1 pip wheel deepspeed==<installed version>`), kept in
~/.cache/ds-megatron-toolkit/deepspeed-ops/KEY/ and installed into the running venv with pip
(seconds); KEY names everything the binaries depend on: DeepSpeed, torch, Python, machine,
the CPU's instruction set (DeepSpeed compiles for the build machine's CPU) and the ops. DeepSpeed
then imports the installed ops instead of compiling. A venv whose DeepSpeed already has them
is left alone. DS_OPS_CACHE overrides the cache folder.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

OPS = {"cpu_adam": "DS_BUILD_CPU_ADAM", "fused_adam": "DS_BUILD_FUSED_ADAM", "deepspeed_shm_comm": "DS_BUILD_SHM_COMM"}
LOADER = ("from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, FusedAdamBuilder, ShareMemCommBuilder\n"
          "for b in (CPUAdamBuilder(), FusedAdamBuilder(), ShareMemCommBuilder()): b.load(verbose=False)\n"
          "from deepspeed.git_version_info import installed_ops\n"
          "print(sorted(k for k, v in installed_ops.items() if v))\n")


def cpu_flags() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    return next((ln for ln in lines if ln.startswith("flags")), platform.processor())


def cache_dir() -> Path:
    import torch

    ds = metadata.version("deepspeed")
    build = hashlib.sha256((cpu_flags() + "|" + ",".join(sorted(OPS))).encode()).hexdigest()[:12]
    key = f"deepspeed-{ds}-torch-{torch.__version__}-{sys.implementation.cache_tag}-{platform.machine()}-{build}"
    root = Path(os.environ.get("DS_OPS_CACHE", Path.home() / ".cache" / "ds-megatron-toolkit" / "deepspeed-ops"))
    return root / key


def ops_installed() -> bool:
    from deepspeed.git_version_info import installed_ops

    return all(installed_ops.get(name, False) for name in OPS)


def build_wheel(dest: Path) -> Path:
    """Compile DeepSpeed (the installed version, from its source release) with the ops."""
    # DS_ENABLE_NINJA: DeepSpeed's setup.py builds pre-installed ops without ninja unless told; with it, torch's
    # BuildExtension compiles each op's sources in parallel (MAX_JOBS), the two heavy Adam translation units at once.
    # ninja is the `ninja` distribution beside this interpreter, hence the PATH.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0", **{var: "1" for var in OPS.values()},
           "DS_ENABLE_NINJA": "1", "MAX_JOBS": str(os.cpu_count() or 1), "PATH": path}
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "wheel", f"deepspeed=={metadata.version('deepspeed')}",
                        "--no-deps", "--no-build-isolation", "--no-binary", "deepspeed", "--no-cache-dir",
                        "-w", tmp], env=env, check=True)
        (wheel,) = Path(tmp).glob("deepspeed-*.whl")
        dest.mkdir(parents=True, exist_ok=True)
        partial = dest / f".{wheel.name}.partial"
        shutil.copy2(wheel, partial)
        os.replace(partial, dest / wheel.name)
    return dest / wheel.name


def main() -> int:
    if ops_installed():
        print("deepspeed ops: already installed in this environment")
        return 0
    dest = cache_dir()
    wheels = sorted(dest.glob("deepspeed-*.whl"))
    if wheels:
        print(f"deepspeed ops: installing the cached build {wheels[-1]}")
    else:
        print(f"deepspeed ops: compiling {', '.join(OPS)} once for this machine (minutes) into {dest}", flush=True)
    wheel = wheels[-1] if wheels else build_wheel(dest)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
                   check=True)
    loaded = subprocess.run([sys.executable, "-c", LOADER], capture_output=True, text=True,
                            env={**os.environ, "DS_ACCELERATOR": "cpu"})
    if loaded.returncode != 0 or not all(name in loaded.stdout for name in OPS):
        print(f"deepspeed ops: the installed ops do not load:\n{loaded.stdout}{loaded.stderr[-2000:]}", file=sys.stderr)
        return 1
    print(f"deepspeed ops: ready ({loaded.stdout.strip()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
