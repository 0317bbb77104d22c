"""Executing the IR: what runs a rank's action lists, knowing no schedule and no option.

* :mod:`.interpreter`: the loop and the communication, a table of handlers for the rest; :mod:`.compute`: the
  F, B, I and W handlers (:mod:`.hints`: why a stage's forward or loss failed, in the user's terms); :mod:`.run`:
  the run value every part of a run is given; :mod:`.timings`: the timeline a run records; :mod:`.backward`: the
  backward split into I and W (:mod:`.deferred`: the weight-gradient kernels W runs from what I stashed;
  :mod:`.spans`: the bytes tensors span in their storages, each byte once);
* :mod:`.runner`: the one step protocol (every train step, window and wave), and its seam :class:`.runner.StepPart`;
* :mod:`.hooks`: what SYNC and STEP do for a stage, and its seam :class:`.hooks.StagePart`;
* :mod:`.stage`: a stage's layers under the calling convention; :mod:`.batches`: a run's micro-batches
  (:mod:`.eval_inputs`: an evaluation's, agreed by every rank before anything is sent; :mod:`.given_batches`:
  the first train step's check that the ranks were given one batch);
  :mod:`.microbatch`: cutting and merging batches; :mod:`.tree`: nested values as flat tensors;
* :mod:`.messages`: what crosses between stages; :mod:`.forensics`: where a rank stood when it failed;
  :mod:`.reports`: timelines and losses gathered after a step.
"""
