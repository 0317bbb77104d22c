"""Which transport a pipeline gets: ``transport=`` as a name or a factory, ``auto`` by default.

It stands above both transports' rooms (:mod:`.transport`, :mod:`.shm`): the shared-memory transport builds on
the point-to-point pieces, and the choice knows them both, so no room of ``comm/`` imports another round a
circle (``tests/core/test_import_circles.py``).

* ``"torch"`` (:func:`torch_transport`): torch.distributed point-to-point, gloo or NCCL; works everywhere.
* ``"shm"`` (:func:`~.shm.transport.shm_transport`): shared memory between processes of one host (gloo groups on
  x86-64 Linux); an error naming the ranks elsewhere otherwise.
* ``"auto"`` (:func:`auto_transport`): shm when the group's backend is gloo and every rank is on this host
  (same host name, boot id, pid and mount namespaces, gathered when the pipeline is built), else torch.

When ``transport`` is not given, the environment variable ``STAGEWISE_TRANSPORT`` may name one (the tests run
the runtime checks once per transport this way); else ``auto``.
"""

from __future__ import annotations

import os

from .groups import backend_of
from .shm.transport import ShmTransport, gather_peers, same_host, shm_transport
from .transport.protocol import Transport, TransportFactory, TransportSpec, guard_for
from .transport.torch_p2p import TorchTransport

ENV = "STAGEWISE_TRANSPORT"
NAMES = ("auto", "shm", "torch")
DEFAULT = "auto"

TransportChoice = str | TransportFactory | None


def torch_transport(spec: TransportSpec) -> TorchTransport:
    """torch.distributed point-to-point (gloo on CPU, NCCL on GPU): across hosts, and on GPUs."""
    return TorchTransport(spec)


def auto_transport(spec: TransportSpec) -> Transport:
    """Shared memory when every rank of a gloo group is on this host, else torch.distributed (a collective)."""
    guard = guard_for(spec)  # made once, for whichever transport is picked
    if backend_of(spec.group) != "gloo":
        return TorchTransport(spec, guard)
    peers = gather_peers(spec.group, guard.wait)  # its board and deadline watch the gather: a failing rank is named
    return ShmTransport(spec, peers, guard) if same_host(peers) else TorchTransport(spec, guard)


_FACTORIES: dict[str, TransportFactory] = {"auto": auto_transport, "shm": shm_transport, "torch": torch_transport}


def check_choice(choice: TransportChoice) -> None:
    """Refuse an unknown transport name (or a non-callable) before anything is built."""
    if choice is None or callable(choice):
        return
    if not isinstance(choice, str) or choice not in _FACTORIES:
        raise ValueError(
            f"transport must be one of {', '.join(repr(n) for n in NAMES)} or a factory TransportSpec -> Transport, "
            f"got {choice!r}"
        )


def resolve(choice: TransportChoice) -> TransportFactory:
    """The factory for ``choice``; None reads ``STAGEWISE_TRANSPORT`` (default ``auto``)."""
    if choice is None:
        choice = os.environ.get(ENV, "").strip() or DEFAULT
        if choice not in _FACTORIES:
            raise ValueError(f"{ENV} must be one of {', '.join(NAMES)}, got {choice!r}")
    check_choice(choice)
    return choice if callable(choice) else _FACTORIES[choice]
