"""Not a test module: the reference for the runtime's multi-token prediction, run as an item of
tests/support/runtime_worker.py ("mtp_reference").

megatron-core's own GPTModel with its own MTP block spec (get_gpt_decoder_block_spec +
get_gpt_mtp_block_spec, local spec), the whole model in this one process (tp = pp = ep = 1),
loads a checkpoint the runtime saved (megatron's dist_checkpointing.load, strict) and takes
the next step's global batch as megatron's schedule would: every micro-batch's main loss
(mean over its unmasked tokens) divided by the number of micro-batches, the MTP and MoE
auxiliary losses through megatron's autoscalers with the same 1 / micro-batches factor. It
records the main loss and the MTP loss (megatron's tracker, averaged over the micro-batches),
the gradient norm over all weights and over the MTP block's, and how far the MTP weights of
a later checkpoint of the run are from this one's.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch


def build_reference(plan):
    """megatron's GPTModel with the MTP block, fp32 on CPU, for a tp = pp = ep = 1 plan."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

    from toolkit.emit.megatron import gpt_model_kwargs
    from toolkit.mcore.model import transformer_config

    config = transformer_config(plan)
    assert config.mtp_num_layers, "the reference is for a model with MTP modules"
    layers = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    mtp = get_gpt_mtp_block_spec(config, layers, use_transformer_engine=False)
    return GPTModel(config=config, transformer_layer_spec=layers, mtp_block_spec=mtp, pre_process=True,
                    post_process=True, **gpt_model_kwargs(plan))


def load(model, folder: Path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.safe_globals import register_safe_globals
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    register_safe_globals()
    sharded = model.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))
    state = dist_checkpointing.load(sharded, str(folder), strict="raise_all")
    model.load_state_dict(state, strict=True)


def step_losses(model, plan, dataset, step: int) -> dict:
    """Forward and backward of global batch number ``step`` (0-based) on the whole model."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    from toolkit.mcore import cpu_compat
    from toolkit.runtime import data

    b = plan.batch
    batches = [data.collate(dataset, ids, torch.device("cpu"))
               for ids in data.sample_ids(step * b.global_, b.micro, b.global_, 1, 0)]
    n = len(batches)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0 / n))
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / n))
    MTPLossLoggingHelper.tracker.clear()
    model.train()
    model.zero_grad()
    main = 0.0
    for mb in batches:
        mask = mb["loss_mask"].float()
        per_token = model(input_ids=mb["tokens"], position_ids=mb["position_ids"],
                          attention_mask=cpu_compat.causal_mask(mb["tokens"].shape[1], mb["tokens"].device),
                          labels=mb["labels"], loss_mask=mask)
        loss = (per_token * mask).sum() / mask.sum()
        (loss / n).backward()
        main += float(loss) / n
    mtp = [float(v) / n for v in MTPLossLoggingHelper.tracker.pop("values")]
    MTPLossLoggingHelper.tracker.clear()
    def norm(params) -> float:
        return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None))

    return {"loss": main, "mtp_loss": mtp, "grad_norm": norm(model.parameters()),
            "mtp_grad_norm": norm(model.mtp.parameters())}


def mtp_change(model, later: Path) -> float:
    """Largest |difference| of an MTP weight between this model and a later checkpoint's."""
    before = {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("mtp.") and
              isinstance(v, torch.Tensor) and v.is_floating_point()}
    load(model, later)
    after = model.state_dict()
    return max(float((after[k] - v).abs().max()) for k, v in before.items())


def run_reference(plan, item: dict) -> dict:
    """item["mtp_reference"]: {"checkpoint": training checkpoint folder after step N, "later":
    a later one, "data": the run's dataset prefix, "step": N}."""
    from toolkit.mcore.distributed import init_parallel
    from toolkit.runtime import data

    ref = item["mtp_reference"]
    init_parallel(plan.layout, plan.spec.train.seed)
    model = build_reference(plan)
    load(model, Path(ref["checkpoint"]) / "model")
    dataset = data.build_dataset(ref["data"], plan.batch.seq_len, plan.spec.train.seed, plan.shape.vocab_size,
                                 Path(item["out"]) / "data_cache")
    facts = step_losses(model, plan, dataset, ref["step"])
    facts["mtp_weight_change"] = mtp_change(model, Path(ref["later"]) / "model")
    if torch.distributed.get_rank() == 0:  # the later checkpoint's MTP weights that keep their shape in HF
        sd = model.state_dict()
        Path(item["out"]).mkdir(parents=True, exist_ok=True)
        torch.save({k: sd[f"mtp.layers.0.{k}"] for k in MTP_ONE_TO_ONE}, Path(item["out"]) / "mtp_later.pt")
    return facts


# megatron name under mtp.layers.K -> DeepSeek-V3's HF name under model.layers.{num_layers + K}
MTP_ONE_TO_ONE = {"eh_proj.weight": "eh_proj.weight", "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
                  "final_layernorm.weight": "shared_head.norm.weight"}
