"""Optional per-step behaviour, one file per option of :class:`~stagewise.Pipeline`.

Each plugs into the engine through one of its seams, registered by :mod:`stagewise.runtime.assembly.assemble`:
a stage's forward, a stage's SYNC / STEP (:class:`~stagewise.runtime.engine.hooks.StagePart`) or each step as a
whole (:class:`~stagewise.runtime.engine.runner.StepPart`); the engine imports none of them:

* :mod:`.precision` (``autocast=``), :mod:`.recompute` (``recompute=``), :mod:`.batchnorm` (``batchnorm=``;
  :mod:`.batchnorm_moments`: its statistics; :mod:`.update_bn`: the running statistics estimated again),
  :mod:`.finite` (``nan_policy=``), :mod:`.clip` (``clip_grad_norm_``), :mod:`.aux_loss` (auxiliary losses),
  :mod:`.memory` (``measure_memory=``), :mod:`.offload` (``offload=``), :mod:`.merge` (``no_sync()``, a gradient
  merge), :mod:`.dropout` (masks seeded alike under every layout: ``dropout_seed=``), :mod:`.owned_step`
  (``lr_scheduler=``, ``clip=``), :mod:`.evaluation` (``eval_loss``, the eval inputs' structure).
"""
