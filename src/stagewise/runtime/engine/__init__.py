"""Executing the IR: what runs a rank's action lists, knowing no schedule and no option.

* :mod:`.interpreter`: one handler per action kind; :mod:`.backward`: the backward split into I and W
  (:mod:`.deferred`: the weight-gradient kernels W runs from what I stashed; :mod:`.spans`: the bytes tensors
  span in their storages, each byte once);
* :mod:`.runner`: the one step protocol (every train step, window and wave), and its seam :class:`.runner.StepPart`;
* :mod:`.hooks`: what SYNC and STEP do for a stage, and its seam :class:`.hooks.StagePart`;
* :mod:`.stage`: a stage's layers under the calling convention; :mod:`.step`: a step's micro-batches;
  :mod:`.microbatch`: cutting and merging batches; :mod:`.tree`: nested values as flat tensors;
* :mod:`.messages`: what crosses between stages; :mod:`.forensics`: where a rank stood when it failed;
  :mod:`.reports`: timelines and losses gathered after a step.
"""
