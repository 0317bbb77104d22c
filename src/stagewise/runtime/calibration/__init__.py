"""Calibration on the actual group: pipelines run to measure what a layer profile cannot see.

Above the facade: each probe builds small :class:`~stagewise.Pipeline` runs (what measures a module or a link
alone is :mod:`stagewise.runtime.measure`); the planner reads the results as plain data
(:mod:`stagewise.planning.calibration`).

* :mod:`.calibrate`: links, per-action and per-message costs, the cores, FSDP2's cost
  (:func:`stagewise.calibrate`), with :mod:`.layout_probe` (what each layout costs beyond the model);
* :mod:`.from_run`: the cost model recalibrated from a running pipeline's own timeline, and a slow rank named
  (:class:`~stagewise.runtime.calibration.from_run.RunCalibrator`), with :mod:`.replicas` (the data-parallel
  replicas' all-reduces gathered on one clock, for the link fit) and :mod:`.arguments` (what it is given, checked
  where it is built);
* :mod:`.replan`: the run re-planned live from that calibration, through ``pipe.relayout``
  (:class:`~stagewise.runtime.calibration.replan.Replanner`), with :mod:`.held` (when a held rank is probed, and
  what the probe found), :mod:`.probe` (a rank's share of a core, by a busy loop or its cgroup quota: a quota
  lifted shows there) and :mod:`.lead` (one rank watches for all; the others send their steps one way);
* :mod:`.compute_scale`: the runtime's compute over the profile's prediction;
* :mod:`.progress`: the bar rank 0 draws while they run.
"""
