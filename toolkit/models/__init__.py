"""Model shapes: HF config <-> ModelShape, named models, parameter counts."""
from .params import active_params, largest_module_params, total_params
from .registry import (FAMILIES, UnsupportedArchitectureError, family_of, hf_config_dict, load_model,
                       named_models, read_hf_config, shape_from_hf)
from .shape import MLAShape, ModelShape, MoEShape

__all__ = ["FAMILIES", "MLAShape", "ModelShape", "MoEShape", "UnsupportedArchitectureError", "active_params",
           "family_of", "hf_config_dict", "largest_module_params", "load_model", "named_models",
           "read_hf_config", "shape_from_hf", "total_params"]
