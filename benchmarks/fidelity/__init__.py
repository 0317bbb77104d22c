"""The simulator against the runtime (issue 39, items 4 and 5): ``python -m benchmarks.fidelity [--pays]``.

:mod:`.__main__` drives one torchrun job per workload and rank count, :mod:`.worker` is one rank of it,
:mod:`.workloads` the models, :mod:`.predicted` the simulator's side, :mod:`.breakdown`, :mod:`.report` and
:mod:`.tables` turn the measurements into rows, checks and markdown (pure: no torch), :mod:`.pictures` draws.
"""
