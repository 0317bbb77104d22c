"""A model built whole by the user (``from_model`` / ``from_hf``) through a re-layout: the new stages are built
from the model's meta twin (:mod:`stagewise.runtime.frontends.meta_twin`) and filled from the live owners; once
every process has committed, the old model's tensors are let go."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from ..frontends.from_model import FromModel, free_other_stages
from ..frontends.hf import FromHF
from ..frontends.meta_twin import meta_twin
from ..frontends.parts import Frontend
from ..options import Options

BUILT_WHOLE = (FromModel, FromHF)


def twin_of(frontend: Frontend, options: Options) -> Frontend:
    """The way in the new layout is built from: a model whose other parts were freed (``free_unused``) is built
    from its meta twin (the structure, no memory); any other as it is."""
    if not (options.free_unused and isinstance(frontend, BUILT_WHOLE)):
        return frontend
    twin: Any = copy.copy(frontend)
    twin.model = meta_twin(frontend.model)
    return twin


def release_model(frontend: Frontend, options: Options) -> None:
    """After the commit point: the old model's tensors (the new stages alias the kept ones) go to ``meta``, as
    ``free_unused`` does for other ranks' parts; its non-persistent buffers stay (no state moves them)."""
    if not (options.free_unused and isinstance(frontend, BUILT_WHOLE)):
        return
    model: nn.Module = frontend.model
    keep = {id(b) for m in model.modules() for n, b in m._buffers.items() if n in m._non_persistent_buffers_set}
    free_other_stages(model, keep)
