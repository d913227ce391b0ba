"""The launch's rank count against the plan's layout: checked before the runtime's imports
(torch, megatron-core, DeepSpeed: seconds per rank), so a launch with the wrong number of
ranks fails at once on every rank."""
from __future__ import annotations

from ..errors import ToolkitError


class WorldSizeError(ToolkitError):
    exit_code = 2


def check_world(plan, found: int) -> None:
    lay = plan.layout
    if found != lay.world:
        parts = " x ".join(f"{k}{v}" for k, v in (("tp", lay.tp), ("pp", lay.pp), ("cp", lay.cp), ("dp", lay.dp))
                           if v > 1 or k in ("tp", "dp"))
        raise WorldSizeError(f"needs {lay.world} ranks ({parts}), found {found}")
