"""Measurement of a module or a link on the actual device and group: what the planner's cost model needs.

Below the facade: nothing here builds a Pipeline (what does is :mod:`stagewise.runtime.calibration`).

* :mod:`.profiling`: per-layer time and memory (:func:`stagewise.profile`), with :mod:`.layer_cost` (one
  layer measured) and :mod:`.checkpoint_cost` (the line a checkpointed segment costs);
* :mod:`.counting`: per-layer FLOPs, bytes and operators counted on the meta device (the default cut), with
  :mod:`.routed_experts` (transformers' mixture-of-experts layers, whose routing has no meta shapes);
* :mod:`.links`: the ping-pong link probe; :mod:`.sharding`: one FSDP2 unit's cost per step;
* :mod:`.host_reads`: the host reads of tensor values stagewise's own code makes (the sync audit);
* :mod:`.tensor_bytes`: the peak of live tensor bytes over a block (a re-layout's extra memory, not RSS);
* :mod:`.cores`: each local rank pinned to its own share of the cores (``stagewise run --pin-cores``).
"""
