"""Plan -> artifacts: pure functions returning file contents, and one atomic writer."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..atomic import atomic_output_dir
from .deepspeed import deepspeed_config
from .hf import accelerate_yaml
from .launch import deepspeed_script, hostfile, slurm_script, torchrun_script
from .megatron import gpt_model_kwargs, layer_spec, megatron_lm_args, transformer_config_kwargs

if TYPE_CHECKING:  # annotations only: the emitters read a Plan, they never make one
    from ..plan import Plan

EXECUTABLE = {"launch_deepspeed.sh", "launch_torchrun.sh", "slurm.sbatch"}


def _json(d) -> str:
    return json.dumps(d, indent=2) + "\n"


def artifacts(plan: Plan, out_dir: str | Path) -> dict[str, str]:
    """File name -> content for every generated file. `out_dir` is where they will live, as
    the user named it: accelerate opens the DeepSpeed file its config names from the launch's
    working directory, so a relative `out_dir` gives a relative path (the folder can be
    copied to a cluster and launched from the same relative place)."""
    plan.require_valid()
    out = Path(out_dir)
    return {
        "ds_config.json": _json(deepspeed_config(plan)),
        "ds_config_hf.json": _json(deepspeed_config(plan, hf=True)),
        "megatron_config.json": _json(transformer_config_kwargs(plan)),
        "megatron_model.json": _json({"gpt_model": gpt_model_kwargs(plan), "layer_spec": layer_spec(plan)}),
        "megatron_lm_args.txt": " \\\n".join(_flag_lines(megatron_lm_args(plan))) + "\n",
        "accelerate_config.yaml": accelerate_yaml(plan, out / "ds_config_hf.json"),
        "launch_deepspeed.sh": deepspeed_script(plan),
        "hostfile": hostfile(plan),
        "launch_torchrun.sh": torchrun_script(plan),
        "slurm.sbatch": slurm_script(plan),
        "spec.yaml": plan.spec.to_yaml(),
        "plan.json": _json(plan.as_dict()),
    }


def _flag_lines(args: list[str]) -> list[str]:
    """One line per flag with its values."""
    lines: list[list[str]] = []
    for a in args:
        if a.startswith("--") or not lines:
            lines.append([a])
        else:
            lines[-1].append(a)
    return [" ".join(line) for line in lines]


def write_artifacts(plan: Plan, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Write every artifact into `out_dir` atomically (nothing is written for an invalid plan)."""
    files = artifacts(plan, out_dir)
    with atomic_output_dir(out_dir, overwrite) as tmp:
        for name, text in files.items():
            p = tmp / name
            p.write_text(text)
            if name in EXECUTABLE:
                p.chmod(0o755)
    return Path(out_dir)


__all__ = ["artifacts", "deepspeed_config", "gpt_model_kwargs", "megatron_lm_args", "transformer_config_kwargs",
           "write_artifacts"]
