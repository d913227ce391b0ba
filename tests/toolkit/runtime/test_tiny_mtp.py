"""`toolkit tiny-model qwen3-next-tiny` writes the MTP module the hub's Qwen3-Next checkpoints hold
(toolkit.runtime.tiny_mtp), and `toolkit convert hf-to-megatron` of that folder carries it into
megatron-core's MultiTokenPredictionLayer names (one process, tp1)."""
from __future__ import annotations

from dataclasses import replace

import torch
from safetensors.torch import load_file

from toolkit.cli import main


def test_tiny_qwen3_next_has_its_mtp_module_and_it_converts(tmp_path):
    from converters.formats.megatron import open_megatron
    from converters.mapping import ModelMap
    from toolkit.models import named_models, shape_from_hf

    hf, mg = tmp_path / "hf", tmp_path / "mg"
    assert main(["tiny-model", "qwen3-next-tiny", str(hf)]) == 0
    tensors = load_file(hf / "model.safetensors")
    mtp = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
    shape = shape_from_hf(named_models()["qwen3-next-tiny"]["config"])
    want = {k: s for k, s in ModelMap(replace(shape, mtp_layers=1), 512).hf_shapes.items()
            if k.startswith("mtp.")}  # the converters' table: HF's names and shapes of one module
    assert {k: tuple(v.shape) for k, v in mtp.items()} == want
    assert len(mtp) == 41  # fc, 3 norms, the layer's 37 (8 experts x 3 + 13)
    assert mtp["mtp.fc.weight"].abs().max() > 0 and mtp["mtp.layers.0.mlp.gate.weight"].abs().max() > 0

    assert main(["convert", "hf-to-megatron", str(hf), str(mg)]) == 0
    assert open_megatron(mg).shape.mtp_layers == 1
    model = torch.load(mg / "release/mp_rank_00/model_optim_rng.pt", weights_only=False)["model"]
    for megatron, name in {"mtp.layers.0.eh_proj.weight": "mtp.fc.weight",
                           "mtp.layers.0.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
                           "mtp.layers.0.final_layernorm.weight": "mtp.norm.weight",
                           "mtp.layers.0.transformer_layer.mlp.router.weight": "mtp.layers.0.mlp.gate.weight"}.items():
        assert torch.equal(model[megatron], mtp[name]), megatron
    assert sum(k.startswith("mtp.layers.0.transformer_layer.") for k in model) > 10
