"""A model that declares its state through the pipeline this rank runs: :class:`~stagewise.HetPipe`.

A HetPipe is one pipeline per virtual worker, plus the wave rule. On each rank, every member of
:class:`.declared.PipelineState` is its virtual worker's pipeline's: that pipeline's layout, tensors, optimizers,
schedulers and progress are what this rank holds. So :class:`StateThrough` answers each member from
``self.declared`` (reads and writes alike), and mypy checks that a HetPipe implements the protocol
(``hetpipe.py``'s last lines). What the protocol cannot say of a HetPipe - the wave rule's base and sums, and that
its tensors are saved per virtual worker - it declares through :class:`.parts.SavedInParts`, which every reader
asks first (a checkpoint, a resume, an in-place take-over's refusal).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import torch
from torch import nn

from .declared import Mesh, PipelineState, StateSource, TiedGroups

if TYPE_CHECKING:
    from ...ir import Schedule
    from ..comm.transport.protocol import Transport

T = TypeVar("T")


class Through(Generic[T]):
    """A member read from, and written to, the owner's ``declared`` pipeline."""

    def __init__(self, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, owner: None, kind: Any) -> Through[T]: ...
    @overload
    def __get__(self, owner: StateThrough, kind: Any) -> T: ...
    def __get__(self, owner: StateThrough | None, kind: Any) -> T | Through[T]:
        return self if owner is None else getattr(owner.declared, self.name)

    def __set__(self, owner: StateThrough, value: T) -> None:
        setattr(owner.declared, self.name, value)


class StateThrough:
    """:class:`.declared.PipelineState`'s members, each this rank's pipeline's (:attr:`declared`)."""

    @property
    def declared(self) -> PipelineState:
        """The pipeline whose state this rank holds (a subclass says which)."""
        raise NotImplementedError

    schedule: Through[Schedule] = Through("schedule")
    layer_ranges: Through[list[range]] = Through("layer_ranges")
    device: Through[Any] = Through("device")
    transport: Through[Transport] = Through("transport")
    optimizers: Through[dict[int, torch.optim.Optimizer]] = Through("optimizers")
    options: Through[Any] = Through("options")
    frontend: Through[Any] = Through("frontend")
    train_steps: Through[int] = Through("train_steps")
    dropout_seed: Through[int] = Through("dropout_seed")
    schedulers: Through[dict[int, Any]] = Through("schedulers")
    snapshots: Through[Any] = Through("snapshots")
    replanned_cut: Through[list[int] | None] = Through("replanned_cut")

    @property
    def tied(self) -> TiedGroups:
        return self.declared.tied

    @property
    def local_stages(self) -> tuple[int, ...]:
        return self.declared.local_stages

    @property
    def hybrid(self) -> Mesh | None:
        return self.declared.hybrid

    @property
    def merged_steps(self) -> int:
        return self.declared.merged_steps

    @property
    def tied_copies(self) -> dict[str, nn.Module]:
        return self.declared.tied_copies

    def state_sources(self) -> list[StateSource]:
        return self.declared.state_sources()
