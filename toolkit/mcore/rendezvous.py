"""The launch's rendezvous port, checked before any rank waits on it (no torch import here:
rank 0 checks it before the imports that take its peers seconds)."""
from __future__ import annotations

import errno
import os
import socket
import sys

from ..errors import ToolkitError


class PortInUseError(ToolkitError):
    """Another process (another launch) listens on the port this launch's rank 0 must host its store on."""


def hosts_store() -> bool:
    """Whether this process will host the launch's TCPStore: rank 0 of an env:// launch whose
    process group is not up yet, unless torchrun's agent hosts the store itself
    (TORCHELASTIC_USE_AGENT_STORE)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return False
    return os.environ.get("RANK") == "0" and int(os.environ.get("WORLD_SIZE", "1")) > 1 \
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def check_master_port() -> None:
    """Rank 0 hosts the rendezvous store on MASTER_PORT (the deepspeed launcher's default is
    29500). When another launch on this machine holds the port, torch fails with a 35-line
    EADDRINUSE traceback, and the other ranks may talk to the other launch's store; this says
    it in one line, with the launcher flag that picks another port."""
    if not hosts_store():
        return
    port = int(os.environ.get("MASTER_PORT", "29500"))
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store does: a closed run's port is free
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise PortInUseError(f"port {port} (MASTER_PORT) is in use on this machine, by another launch? Start this "
                                 "one on a free port: `deepspeed --master_port N ...` (torchrun: --master_port N)"
                                 ) from None


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def one_process_env() -> dict[str, str]:
    """The launcher's variables of a world of this one process, on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port))


def single_process_env(launch_hint: str) -> str | None:
    """Without a launcher (no RANK): make this process rank 0 of 1 on a free local port and
    return the note that says so and how to launch more ranks (None under a launcher)."""
    if "RANK" in os.environ:
        return None
    os.environ.update(one_process_env())
    return f"note: no launcher (RANK is not set): training on this one process; for N ranks: {launch_hint}"
