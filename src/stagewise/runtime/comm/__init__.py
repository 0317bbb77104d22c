"""Communication: the only room of stagewise (with the hybrid axes' torch wrappers) that talks to torch.distributed.

Three rooms and a few modules at the root:

* :mod:`.transport`: the :class:`Transport` protocol the engine speaks (moving values between the ranks of a
  pipeline), the torch.distributed point-to-point transport;
* :mod:`.shm`: the same-host transport, through shared memory (on the point-to-point pieces of :mod:`.transport`);
  :mod:`.choose_transport`, above both, is how ``transport=`` picks one;
* :mod:`.faults`: failure handling - the :class:`Guard` every transport is given (error board, deadlines,
  forensics), the heartbeat, the exit hook;
* :mod:`.setup` joins the process group (``stagewise.init()``); :mod:`.attempt_store` finds the store a
  torchrun job meets on; :mod:`.groups` names groups and stores; :mod:`.coordinator` is the run's corner of
  the store; :mod:`.collectives` holds the collectives stagewise issues; :mod:`.wsp` HetPipe's delayed sums;
  :mod:`.lifecycle` lets go of process groups at exit; :mod:`.blocking` counts the helper threads inside a
  blocking torch call, none of which may be left when the interpreter finalizes; :mod:`.snapshot_wire` is the
  snapshots' group (``snapshot=``) and :mod:`.snapshot_exchange` a copy's exchange with the peer machines;
  :mod:`.relayout_wire` makes a re-layout's fresh groups and moves its tensors (``Pipeline.relayout``);
  :mod:`.rendezvous_host` runs a rendezvous store on its own; :mod:`.machine` names this process's machine;
  :mod:`.generations` makes the process group of an in-place elastic job's generation (``sw.runtime.InPlace``);
  :mod:`.release` keeps a failed generation's process groups (never its tensors) until their timeout has
  passed, then lets them go off the recovery's thread.
"""

from .faults.guard import Guard
from .transport.protocol import Op, Transport, TransportFactory, TransportSpec

__all__ = ["Guard", "Op", "Transport", "TransportFactory", "TransportSpec"]
