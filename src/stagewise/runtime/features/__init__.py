"""Optional per-step behaviour, one file per option of :class:`~stagewise.Pipeline`.

Each plugs into the step through the runner's protocol or a stage's SYNC / STEP hooks
(:class:`~stagewise.runtime.engine.hooks.StagePart`); the interpreter knows none of them:

* :mod:`.precision` (``autocast=``), :mod:`.recompute` (``recompute=``), :mod:`.batchnorm` (``batchnorm=``),
  :mod:`.finite` (``nan_policy=``), :mod:`.clip` (``clip_grad_norm_``), :mod:`.aux_loss` (auxiliary losses),
  :mod:`.memory` (``measure_memory=``), :mod:`.offload` (``offload=``).
"""
