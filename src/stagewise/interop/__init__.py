"""Other libraries' schedules, read into stagewise and written back: torch.distributed.pipelining (and so
torchtitan, which loads torch's schedule CSV files).

Pure, like the rest of the core: torch's actions are read as text or by duck typing. Making a torch
schedule class's order needs torch's stage objects, so that half lives in the runtime
(``stagewise.runtime.torch_order``), which returns a :class:`TorchOrder` for :func:`from_torch`.

* :mod:`.torch_words`: torch's action words and stagewise's, both ways;
* :mod:`.torch_orders`: :func:`from_torch`, :func:`to_torch_csv`, :func:`torch_problems`, :func:`torch_placement`,
  :class:`TorchOrder`;
* :mod:`.torchtitan`: :func:`torchtitan_settings` (the settings that load a file in torchtitan) and
  :func:`torchtitan_problems` (a file checked against a job's settings).
"""

from .torch_orders import (
    FORMATS,
    TorchFormat,
    TorchOrder,
    from_torch,
    to_torch_csv,
    torch_placement,
    torch_problems,
)
from .torchtitan import TorchtitanSettings, torchtitan_problems, torchtitan_settings

__all__ = [
    "FORMATS",
    "TorchFormat",
    "TorchOrder",
    "TorchtitanSettings",
    "from_torch",
    "to_torch_csv",
    "torch_placement",
    "torch_problems",
    "torchtitan_problems",
    "torchtitan_settings",
]
