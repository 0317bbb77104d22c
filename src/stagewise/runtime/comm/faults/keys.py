"""The job-level keys every process of a run reads and writes in the run's corner of the store.

* :data:`JOB_KEY`: the first error any process ended with (posted by :mod:`.exit_hook`; every error board and
  every bounded call of the coordinator watches it);
* :data:`SEEN_KEY` ``/<global rank>``: that rank has read a failure, or failed itself and is leaving - the
  rank whose failure stands waits only for ranks with neither (:mod:`.exit_hook`);
* :data:`ORIGIN_KEY`: the global rank whose failure stands, and :data:`LEFT_KEY`: it is leaving; the ranks that
  read its failure and leave by ``sys.exit`` go after it has gone, so that torchrun's summary names it
  (:mod:`.exit_hook`).
"""

JOB_KEY = "job/error"
SEEN_KEY = "job/seen"
ORIGIN_KEY = "job/origin"
LEFT_KEY = "job/left"
