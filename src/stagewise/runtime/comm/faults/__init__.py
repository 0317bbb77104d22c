"""Failure handling: no rank hangs when another fails, and every survivor names the one at fault.

* :mod:`.guard`: the :class:`~.guard.Guard`, one per pipeline, shared by its transport and its collectives:
  the error board, deadline-bounded waits, "waiting for", how messages name this rank;
* :mod:`.board`: the error board, one key in the c10d store where the first failure is posted;
* :mod:`.waiters`: the helper threads that run blocking gloo waits while the guard watches board and clock;
* :mod:`.heartbeat`: signs of life, to name the rank that is stuck down a chain of waits;
* :mod:`.calls`: the collective calls each process counts per pipeline (steps, evaluations, checkpoints);
* :mod:`.divergence`: a peer in another collective call, or whose script ended, named by a waiting rank;
* :mod:`.probe`: each process's liveness port: a peer whose port refuses is gone (never a live one);
* :mod:`.exit_hook`: how a failing rank leaves (posted, flushed, exit code 1, never an abort);
* :mod:`.failures`: a collective that failed inside torch, told as the pipeline's failure;
* :mod:`.keys`: the job-level keys every process of a run reads and writes in the store.
"""
