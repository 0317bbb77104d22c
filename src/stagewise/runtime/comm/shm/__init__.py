"""The same-host transport: boundary values through shared memory, doorbells through named pipes.

* :mod:`.transport`: :class:`ShmTransport`, the Transport;
* :mod:`.slots`: the layout of a message stream's buffer and the send / receive protocol on it;
* :mod:`.doorbell`: the sleeping wait (one FIFO per rank); :mod:`.peers`: who shares the host;
* :mod:`.names`: the names in ``/dev/shm``, removed even after a kill.
"""
