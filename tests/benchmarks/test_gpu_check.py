"""benchmarks/gpu_check.py, the command for the first machine with a GPU, as far as a CPU can
hold it: every case it runs is a valid layout that fits the GPUs it may meet (so the first GPU
run does not stop at a rule or an OOM the plan already knows), the runtime's CUDA checks accept
each case on such a machine, and without CUDA it says so and exits 0."""
from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import gpu_check
from toolkit.plan import make_plan
from toolkit.runtime.trainer import unsupported
from toolkit.spec import TrainingSpec

from tests.conftest import ROOT, subprocess_env

GPUS = {"h100-80gb": 4, "a100-80gb": 4, "h200-141gb": 4, "a100-40gb": 1}  # -> the layers the check chooses


@pytest.mark.parametrize("gpu", list(GPUS))
def test_the_layers_chosen_fit_every_case(tmp_path, gpu):
    assert gpu_check.choose_layers(tmp_path, 6, gpu) == GPUS[gpu]


@pytest.mark.parametrize("gpu", list(GPUS))
@pytest.mark.parametrize("name", [*gpu_check.LLAMA, gpu_check.MOE])
def test_every_case_is_a_valid_plan_that_fits(tmp_path, name, gpu):
    plan = make_plan(TrainingSpec.from_dict(gpu_check.case_spec(name, tmp_path, GPUS[gpu], 6, gpu)))
    assert plan.valid, plan.errors
    assert plan.layout.world == 1 and plan.gpu.name == gpu
    assert plan.memory.fits(plan.spec.estimate.headroom), plan.memory.worst.gib()
    assert unsupported(plan, cuda=True, te=True) == []
    assert plan.spec.precision == ("fp16" if name.startswith("fp16") else "bf16")


def test_cases_cover_the_issue_grid(tmp_path):
    specs = [TrainingSpec.from_dict(gpu_check.case_spec(n, tmp_path, 4, 6, "h100-80gb")) for n in gpu_check.LLAMA]
    assert {s.recompute for s in specs} == {"none", "selective", "full"}
    assert {s.batch.micro for s in specs} == {1, 2} and {s.batch.seq_len for s in specs} == {4096, 8192}
    assert len(specs) >= 5 and gpu_check.RESUMED in gpu_check.LLAMA


def test_without_cuda_it_says_so_and_exits_0():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True, text=True,
                       env=subprocess_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "gpu_check: no CUDA device on this machine; nothing to check (run it on a machine " \
                               "with one GPU)"
