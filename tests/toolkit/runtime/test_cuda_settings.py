"""The settings the runtime builds on GPUs, built on this CPU machine and validated by the
libraries that consume them: megatron-core's (MLA)TransformerConfig with the CUDA path's
overrides (TransformerEngine layers, flash attention, fused rope, bias-dropout and SwiGLU
fusions; megatron's own __post_init__ checks) and DeepSpeed's DeepSpeedConfig of the runtime's
CUDA config, for every recipe (full size, and the tiny flavour as a GPU runs it) and every
named model of the registry (so every family). CPU tests otherwise build only the CPU path,
where every fusion is off: DeepSeek's tiny flavour once failed at start-up on GPUs only
("apply_rope_fusion for MLA only works with YARN RoPE").

Not built here: megatron's TransformerEngine layer spec (get_gpt_decoder_block_spec with
use_transformer_engine=True names TENorm, undefined unless transformer_engine is installed,
which needs CUDA), hence no GPTModel of the CUDA path either.
"""
import json

import pytest

from toolkit.kernels import spec_kernels
from toolkit.mcore.model import transformer_config
from toolkit.models.registry import named_models
from toolkit.plan import make_plan
from toolkit.runtime.engine import runtime_config
from toolkit.runtime.recipe import tiny_flavor
from toolkit.runtime.trainer import unsupported
from toolkit.spec import TrainingSpec

from tests.conftest import ROOT, PlanMPU, load_recipe, spec_dict

RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.py"))
CASES = [(r, f) for r in RECIPES for f in ("full", "tiny")] + [(m, "registry") for m in named_models()]
LINEAR_ATTENTION = [m for m, e in named_models().items() if e["config"]["architectures"][0] == "Qwen3NextForCausalLM"]


def cuda_plan(name: str, flavour: str):
    """The plan a GPU run of this recipe flavour (or named model, one 8-GPU node) builds."""
    if flavour == "registry":
        return make_plan(TrainingSpec.from_dict(spec_dict(model=name, **{"parallel.tp": 1})))
    mod = load_recipe(name)
    spec = mod.make_spec() if flavour == "full" else tiny_flavor(mod.make_spec(), mod.TINY, 2, cuda=True)
    return make_plan(spec)


@pytest.fixture
def transformer_engine_rope(monkeypatch):
    """megatron's config check for fused rope (non-MLA) only asks whether TransformerEngine's
    kernel was importable (rope_utils.fused_apply_rotary_pos_emb is None without it, and TE
    cannot be installed without CUDA): a GPU machine has it, so it is present here too."""
    from megatron.core.models.common.embeddings import rope_utils

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)


def test_cases_cover_every_family():
    """The registry's named models reach every registered model family."""
    from toolkit.models.family import FAMILIES, family_of

    covered = {family_of(m["config"]["architectures"][0]).name for m in named_models().values()}
    assert covered == {f.name for f in FAMILIES.values()} and len(RECIPES) == 10


@pytest.mark.parametrize("name", LINEAR_ATTENTION)
def test_gated_delta_nets_on_gpus_need_fla(name):
    """megatron-core's GatedDeltaNet raises ImportError without flash-linear-attention (its CPU
    path here is the toolkit's shim): a GPU machine without the fla package is refused at start."""
    plan = cuda_plan(name, "registry")
    [msg] = unsupported(plan, cuda=True, te=True, fla=False)
    assert "needs flash-linear-attention" in msg and "fla package is not importable" in msg
    assert unsupported(plan, cuda=True, te=True, fla=True) == []


@pytest.mark.parametrize("name,flavour", CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_cuda_path_settings_pass_the_libraries_checks(name, flavour, transformer_engine_rope, ds_dist):
    from deepspeed.runtime.config import DeepSpeedConfig

    plan = cuda_plan(name, flavour)
    assert [e for e in plan.errors if not e.startswith("needs ")] == []  # the layout is valid (fit is not the point)
    te = plan.spec.finetune.method != "lora"  # LoRA wraps megatron's local layers (rule runtime_lora)
    assert spec_kernels(plan.spec).transformer_engine == te and unsupported(plan, cuda=True, te=te, fla=True) == []
    cfg = transformer_config(plan, cuda=True)  # megatron's __post_init__ validates it
    assert cfg.transformer_impl == ("transformer_engine" if te else "local") and cfg.bias_dropout_fusion == te
    # megatron fuses SwiGLU (and erf-GeGLU) only: Gemma 3's tanh-GeGLU and GPT-OSS's clamped quick-GeGLU run unfused
    assert cfg.bias_activation_fusion == (plan.shape.activation == "swiglu")
    mla_plain_rope = plan.shape.mla is not None and not plan.shape.rope_scaling
    assert cfg.apply_rope_fusion == (te and not mla_plain_rope)
    assert not cfg.use_cpu_initialization
    ds = runtime_config(plan, cuda=True)
    assert "torch_adam" not in ds.get("optimizer", {}).get("params", {})  # DeepSpeed's fused Adam on GPUs
    checked = DeepSpeedConfig(json.loads(json.dumps(ds)), mpu=PlanMPU(plan.layout.dp * plan.layout.cp))
    assert checked.zero_optimization_stage == plan.spec.zero.stage
