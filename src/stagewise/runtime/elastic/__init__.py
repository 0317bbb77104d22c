"""Elastic pipelines: lost machines, snapshots in the peers' memory, resuming at another world size.

* ``config.py``: ``snapshot=`` (:class:`Snapshots`); ``launch.py``: what ``stagewise run --nnodes MIN:MAX``
  gives torch's elastic agent, and what a failed rendezvous means;
* ``snapshots.py``: taking one after every k-th step (a helper thread, the copy to a peer machine);
  ``snapshot_file.py`` its bytes and digests, ``folder.py`` a machine's folder of them, ``peers.py`` which
  machine holds each rank's copy, ``idle.py`` the helper threads at the core's idle priority;
* ``membership.py``: an in-place job's generations on the store that outlives the machines, and fencing;
  ``joining.py``: a machine back or a spare entering a running in-place job between steps;
  ``agent.py``: torch's agent with a run loop that never restarts workers (``stagewise run --in-place``);
* ``recover.py``: ``sw.checkpoint.resume`` with snapshots; ``choose.py``: which generation, who reads what.

The layout that follows the world size is pure: :class:`stagewise.ElasticLayout` (``stagewise.parallel``).
"""
