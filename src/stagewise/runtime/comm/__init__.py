"""Communication: the only room of stagewise (with the hybrid axes' torch wrappers) that talks to torch.distributed.

``setup`` joins the process group; ``groups`` names groups and stores;
``collectives`` holds the collectives stagewise issues; ``board`` is the error
board every wait watches; ``waits`` bounds each wait by a deadline;
``transport`` defines the :class:`Transport` protocol the engine speaks, and
``torch_p2p`` implements it on torch.distributed point-to-point;
``lifecycle`` lets go of process groups at exit.
"""

from .transport.protocol import Op, Transport, TransportFactory, TransportSpec

__all__ = ["Op", "Transport", "TransportFactory", "TransportSpec"]
