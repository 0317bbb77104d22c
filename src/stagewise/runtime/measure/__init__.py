"""Measurement on the actual device and group: what the planner's cost model needs.

* :mod:`.profiling`: per-layer time and memory (:func:`stagewise.profile`), with :mod:`.layer_cost` (one
  layer measured) and :mod:`.checkpoint_cost` (the line a checkpointed segment costs);
* :mod:`.calibrate`: links, per-action and per-message costs, FSDP2's cost (:func:`stagewise.calibrate`);
* :mod:`.compute_scale`: the runtime's compute over the profile's prediction;
* :mod:`.links`: the ping-pong link probe; :mod:`.sharding`: one FSDP2 unit's cost per step.
"""
