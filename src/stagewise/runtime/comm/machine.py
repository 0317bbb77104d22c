"""Which machine this process is on: one name for the snapshots, the joining newcomers and the calibration's
links, so that they never disagree about where a rank sits."""

from __future__ import annotations

import os
import socket

#: torchrun's number for the machine's agent (``GROUP_RANK``): what tells machines apart where they share a host
#: name (network namespaces on one host). A newcomer that joins in place sets it to its first id.
MACHINE_ENV = "GROUP_RANK"


def agent_number() -> str:
    """This machine's agent number ("0" outside torchrun): what a snapshot's folder and file record."""
    return os.environ.get(MACHINE_ENV, "0")


def machine_id() -> str:
    """This process's machine: torchrun's agent number where it runs one, else the host's name."""
    agent = os.environ.get(MACHINE_ENV)
    return f"agent {agent}" if agent is not None else f"host {socket.gethostname()}"
