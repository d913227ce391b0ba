"""Model shapes: HF config <-> ModelShape, model families (one file each), named models,
weight tables, parameter counts. (The registered families are ``family.families()``: this package
does not name that function, since its subpackage ``families`` would replace it once loaded.)"""
from .family import FAMILIES, Family, UnsupportedArchitectureError, family_of
from .params import active_params, largest_module_params, total_params
from .registry import hf_config_dict, load_model, named_models, read_hf_config, shape_from_hf
from .shape import MLAShape, ModelShape, MoEShape

__all__ = ["FAMILIES", "Family", "MLAShape", "ModelShape", "MoEShape", "UnsupportedArchitectureError",
           "active_params", "family_of", "hf_config_dict", "largest_module_params", "load_model",
           "named_models", "read_hf_config", "shape_from_hf", "total_params"]
