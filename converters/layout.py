"""A checkpoint's parallel layout (toolkit.parallel.layout.Layout: the one layout of the toolkit),
checked with the spine's rules.

Layers are placed exactly as megatron-core places them (``Layout.pipeline``, toolkit.parallel.pipeline):
evenly (with pp stages and vpp virtual chunks, chunk v of stage p holds the n = L/(pp*vpp)
layers starting at (v*pp + p)*n), or unevenly (first / last stage layer counts, or the
embedding / loss counted as a layer), each chunk naming its layers ``decoder.layers.0..n-1``.
"""
from __future__ import annotations

from toolkit.errors import PlanError
from toolkit.models import ModelShape
from toolkit.parallel.layout import Layout


def conversion_plan(shape: ModelShape, layout: Layout, *, precision: str = "fp32", seq_len: int = 64,
                    grouped_gemm: bool = False, token_dispatcher: str = "alltoall"):
    """The spine's Plan for this model at this layout on CPU ranks (one micro-batch per
    pipeline stage so the interleaved-schedule rule holds)."""
    from toolkit.plan import make_plan
    from toolkit.spec import TrainingSpec

    world = layout.world
    spec = TrainingSpec.from_dict({
        "model": shape.architecture, "target": "megatron-lm", "attention": {"backend": "unfused"},
        "cluster": {"nodes": 1, "gpus_per_node": world, "gpu": "cpu"},
        "parallel": {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "ep": layout.ep, "etp": layout.etp,
                     "first_stage_layers": layout.first_stage_layers, "last_stage_layers": layout.last_stage_layers,
                     "embedding_in_split": layout.embedding_in_split, "loss_in_split": layout.loss_in_split},
        "zero": {"stage": 0}, "precision": precision, "recompute": "none",
        "batch": {"micro": 1, "global": layout.dp * layout.pp, "seq_len": seq_len},
        "moe": {"grouped_gemm": grouped_gemm, "token_dispatcher": token_dispatcher},
    })
    return make_plan(spec, shape=shape)


def _mla_problems(shape: ModelShape, tp: int) -> list[str]:
    """megatron's local spec splits MLA's latent down-projections over tp (ColumnParallelLinear)."""
    a = shape.mla
    if a is None:
        return []
    sizes = {"q_lora_rank": a.q_lora_rank or 0, "kv_lora_rank + qk_rope_head_dim": a.kv_lora_rank + a.qk_rope_head_dim}
    return [f"tp={tp} does not divide {name}={n} (megatron-core's local spec splits that down-projection over tp)"
            for name, n in sizes.items() if n % tp]


CHECKPOINT_SCOPES = ("layout", "model")  # toolkit.plan.rules.SCOPES that a checkpoint's layout answers to


def validate_layout(shape: ModelShape, layout: Layout) -> None:
    """Raise the spine's PlanError listing every rule the layout breaks for this model: the
    rules whose scope is a layout of a model (toolkit.plan.rules.SCOPES). Not properties of a
    checkpoint, so not checked: the run's (memory fit, MLA at tp > 1 on the local spec, which
    TransformerEngine's spec trains) and the target's (whether Megatron-LM's flags can express
    the model: the args written carry what they cannot)."""
    plan = conversion_plan(shape, layout)
    errors = [f.message for f in plan.findings if f.level == "error" and f.scope in CHECKPOINT_SCOPES]
    errors += _mla_problems(shape, layout.tp)
    if shape.moe is None and layout.etp not in (None, layout.tp):
        errors.append(f"etp={layout.etp} needs a MoE model; {shape.architecture} has no experts")
    if errors:
        raise PlanError(errors)
