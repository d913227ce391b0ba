"""Hugging Face Trainer and accelerate integration: the spec is the one source of truth.

    args = training_arguments(spec, "out")          # batch, precision, optimizer, schedule, DeepSpeed
    model = load_model(spec, "meta-llama/...", args=args)  # ZeRO-3: weights load partitioned
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[PlanCallback(spec)])
    trainer.train()
    save_model(trainer, "out/final")                 # full 16-bit weights, reload with from_pretrained
    leave_process_group()                            # every rank, before it exits
"""
from .arguments import (SpecMismatchError, UnsupportedLayoutError, accelerate_config, check_training_arguments,
                        deepspeed_config, hf_plan, lr_schedule, spec_arguments, training_arguments)
from .callback import PlanCallback, memory_report, plan_summary
from .model import SaveError, leave_process_group, load_model, save_model

__all__ = ["PlanCallback", "SaveError", "SpecMismatchError", "UnsupportedLayoutError", "accelerate_config",
           "check_training_arguments", "deepspeed_config", "hf_plan", "leave_process_group", "load_model",
           "lr_schedule", "memory_report", "plan_summary", "save_model", "spec_arguments", "training_arguments"]
