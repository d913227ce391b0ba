"""Hugging Face weights in and out of a live, sharded megatron-core model (RL weight sync,
serving), in-process, on the converters' family tables (docs/bridge.md).

    plan = plan_for(hf_dir)                 # parallel_state already initialised
    chunks = build_model(plan)              # this rank's GPTModel chunks (the runtime's builder)
    load_hf(chunks, hf_dir)                 # each rank reads only its own rectangles
    for name, tensor in export_hf(chunks, hf_dir, dst=0):   # collective; full tensors on rank 0
        ...
    save_hf(engine, hf_dir, out_dir)        # also from the runtime's DeepSpeed engine (ZeRO 0-3)
"""
from .build import build_model, layer_specs, plan_for, transformer_config
from .export import export_hf, save_hf, tensor_list
from .live import BridgeError, LiveModel
from .load import load_hf

__all__ = ["BridgeError", "LiveModel", "build_model", "export_hf", "layer_specs", "load_hf", "plan_for",
           "save_hf", "tensor_list", "transformer_config"]
