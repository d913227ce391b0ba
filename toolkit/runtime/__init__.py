"""Running megatron-core models: process groups, the model built from a Plan, DeepSpeed."""
