"""Transports: moving values between the ranks of one pipeline.

* :mod:`.protocol`: the :class:`Transport` protocol the engine speaks, and :class:`TransportSpec`;
* :mod:`.torch_p2p`: torch.distributed point-to-point (gloo, NCCL);
* :mod:`.p2p`: the point-to-point pieces both transports post through (addresses and tags, sends, eager ops).

Which transport ``transport=`` names (``"auto"``, ``"torch"``, ``"shm"``, a factory) is
:mod:`stagewise.runtime.comm.choose_transport`, above both.

The shared-memory transport is its own package, :mod:`stagewise.runtime.comm.shm`; failure handling (the
guard every transport is given) is :mod:`stagewise.runtime.comm.faults`.
"""
