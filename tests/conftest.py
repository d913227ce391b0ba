"""Shared fixtures. Tests run on CPU; DeepSpeed is told so explicitly."""
from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# One intra-op thread in the pytest processes, as in every rank they launch (subprocess_env): beside
# the other xdist worker and its ranks on 2 cores, torch's OpenMP threads spin at each barrier for a
# core another process holds (tests/estimate/test_activations.py alone: 18.4 -> 10.4 s user CPU)
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # loaded by a plugin before this file: its pool is already sized
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
SUPPORT = ROOT / "tests" / "support"  # launch helpers, workers, shared test models, data


PORTS_BELOW_EPHEMERAL = (20000, 32768)  # Linux hands out 32768-60999 for bind(port 0) (ip_local_port_range)
_next_port: list[int] = []


def free_port() -> int:
    """A port for a launch's rendezvous store, free now and not one the kernel hands out to
    anyone asking for any port: below the ephemeral range, a separate slice per pytest-xdist
    worker, never the same twice in one session. (A port from bind(0), released at once, could
    go to another worker's launch, or to one of gloo's own connections, before the store binds
    it: two launches then share a store.)"""
    low, high = PORTS_BELOW_EPHEMERAL
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    width = (high - low) // 8
    if not _next_port:
        _next_port.append(low + (worker % 8) * width + os.getpid() % (width // 2))
    for _ in range(width):
        port = _next_port[0]
        _next_port[0] = port + 1 if port + 1 < low + (worker % 8 + 1) * width else low + (worker % 8) * width
        with socket.socket(socket.AF_INET6) as s:  # the store listens on [::] (both families)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("::", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in this worker's slice of {low}-{high}")


def shm_segments(port: int) -> list[str]:
    """DeepSpeed CPU all-reduce segments left in /dev/shm by a launch on ``port``
    (toolkit.mcore.cpu_compat.release_deepspeed_shm unlinks them)."""
    return sorted(p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: this checkout first on the path, CPU accelerator."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture(autouse=True)
def dynamo_switch_restored():
    """``toolkit convert`` run in-process (tests/toolkit/models/families/test_gemma3.py, ...) sets
    TORCHDYNAMO_DISABLE=1 for its process (kernels.eager_fusions): a later test of the same worker that
    first imports megatron would get its torch.compile'd fusions eager, and
    tests/toolkit/estimate/test_activations.py's GPT-OSS activation would keep other tensors (it did,
    in that order). Restored after each test."""
    before = os.environ.get("TORCHDYNAMO_DISABLE")
    yield
    if os.environ.get("TORCHDYNAMO_DISABLE") != before:
        if before is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = before


@pytest.fixture(scope="module", autouse=True)
def no_process_group_left(request):
    """Tests of several files share a pytest worker process: a default process group a module
    leaves up (its own fixtures torn down) would make the next module's one-rank group fail
    ("initialize the default process group twice"). It is destroyed here, with a warning that
    names the module."""
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    import warnings

    warnings.warn(f"{request.node.nodeid} left the default process group up; destroyed after it", stacklevel=1)
    if "megatron.core.parallel_state" in sys.modules:
        ps = sys.modules["megatron.core.parallel_state"]
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    dist.destroy_process_group()


def spec_dict(**over) -> dict:
    """A small valid spec (Llama-3-8B on one 8-GPU node) with dotted overrides."""
    from toolkit.spec import set_dotted

    d = {"model": "llama3-8b", "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu": "h100-80gb"},
         "parallel": {"tp": 2, "pp": 1}, "zero": {"stage": 1}, "precision": "bf16",
         "batch": {"micro": 1, "global": 64, "seq_len": 4096}, "recompute": "selective"}
    for k, v in over.items():
        set_dotted(d, k.replace("__", "."), v)
    return d


class FakeGroup:
    """A process group's size() and rank() (what megatron's cp slicing and the ring ask)."""

    def __init__(self, size: int = 1, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def load_recipe(name: str):
    """The module of recipes/NAME.py (make_spec, TINY, its docstring)."""
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class PlanMPU:
    """Answers DeepSpeed's data-parallel question from the plan (what an mpu built on
    megatron-core's parallel_state answers at run time)."""

    def __init__(self, dp):
        self.dp = dp

    def get_data_parallel_world_size(self):
        return self.dp


@pytest.fixture(scope="module")
def ds_dist():
    """A one-rank deepspeed.comm group (DeepSpeedConfig reads the world through it), started as the
    runtime starts it (its /dev/shm segment released, whatever LOCAL_SIZE an earlier test left)."""
    from toolkit.mcore.distributed import start_deepspeed_comm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    start_deepspeed_comm("gloo")
    yield
    import torch.distributed

    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def megatron_one_rank():
    """megatron's parallel state over this test process alone (gloo, every group of size 1)."""
    from toolkit.mcore import distributed
    from toolkit.parallel.layout import Layout

    port = free_port()
    mp = pytest.MonkeyPatch()
    # not rendezvous.one_process_env: its LOCAL_WORLD_SIZE would make the process group set LOCAL_SIZE for good
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        mp.setenv(k, v)
    distributed.init_parallel(Layout())
    yield
    distributed.destroy()
    mp.undo()


# The longest files first (seconds each took in a clean-clone run on the 2-core CI machine,
# refreshed from `make test`'s --durations), so that pytest-xdist's two workers (--dist loadfile
# --no-loadscope-reorder: files go out in collection order, a file at a time) end together
# instead of one running a long multi-rank file alone at the end. Files not named keep their
# order after these.
LONGEST_FIRST = {
    "tests/test_readme.py": 304, "tests/toolkit/runtime/test_layouts.py": 190,
    "tests/recipes/test_recipes.py": 155, "tests/toolkit/runtime/test_correctness.py": 151,
    "tests/toolkit/runtime/test_sft.py": 130, "tests/toolkit/runtime/test_deepseek.py": 123,
    "tests/toolkit/runtime/test_resume_layouts.py": 111, "tests/toolkit/runtime/test_agreement.py": 101,
    "tests/toolkit/runtime/test_preemption.py": 95, "tests/toolkit/runtime/test_interrupt.py": 68,
    "tests/toolkit/runtime/test_checkpoint.py": 60, "tests/converters/test_four_ranks.py": 53,
    "tests/toolkit/runtime/test_lora.py": 50, "tests/converters/test_moe.py": 48,
    "tests/toolkit/runtime/test_syncs_and_dropout.py": 46, "tests/toolkit/bridge/test_live_bridge.py": 45,
    "tests/toolkit/runstate/test_hf_trainer.py": 45,
}


def pytest_collection_modifyitems(items: list) -> None:
    """Order files by LONGEST_FIRST; within a file, collection order is kept."""
    gone = [path for path in LONGEST_FIRST if not (ROOT / path).is_file()]
    assert not gone, f"LONGEST_FIRST names files that do not exist: {gone}"
    position = {path: i for i, path in enumerate(sorted(LONGEST_FIRST, key=LONGEST_FIRST.get, reverse=True))}
    items.sort(key=lambda item: position.get(item.nodeid.split("::")[0], len(position)))
