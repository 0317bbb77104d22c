"""The construction path of a pipeline, from the options to the engine around this rank's parts.

:class:`~stagewise.Pipeline`'s constructor reads as the recipe, one call per room:

* :mod:`.auto_schedule`: ``schedule="auto"``, synthesized for the layers' measured costs;
* :mod:`.context`: the validated schedule for the group, then where it runs (the mesh's groups, this rank,
  the device);
* :mod:`.combinations`: every combination of options (and of a HetPipe's) that cannot run exactly, refused;
* :mod:`.agreement`: every rank built with the same options and schedule, or every rank refuses;
* :mod:`.assemble`: the engine around the parts a frontend built, and the parts of every step it registers
  (:mod:`.step_parts`: when in a step the tied sums, the hybrid axes and the activation meter do their work).
"""
