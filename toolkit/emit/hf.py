"""Plan -> accelerate config (YAML text) for `accelerate launch --config_file`."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:  # annotations only: the emitters read a Plan, they never make one
    from ..plan import Plan


def accelerate_config(plan: Plan, ds_config_path: str | Path) -> dict:
    """accelerate's DeepSpeed launcher settings; DeepSpeed itself reads the HF variant of
    the generated config (``ds_config_hf.json``), so the two cannot disagree."""
    c, z = plan.spec.cluster, plan.spec.zero
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {
            "deepspeed_config_file": str(ds_config_path),
            "deepspeed_multinode_launcher": "standard",
            "zero3_init_flag": z.stage == 3,
        },
        "machine_rank": 0,
        "main_process_ip": (plan.spec.launch.hosts or ["node-0"])[0],
        "main_process_port": plan.spec.launch.master_port,
        "main_training_function": "main",
        "num_machines": c.nodes,
        "num_processes": plan.layout.world,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }


def accelerate_yaml(plan: Plan, ds_config_path: str | Path) -> str:
    note = ("# deepspeed_config_file is opened from the working directory of `accelerate launch`\n"
            if not Path(ds_config_path).is_absolute() else "")
    return note + yaml.safe_dump(accelerate_config(plan, ds_config_path), sort_keys=False)
