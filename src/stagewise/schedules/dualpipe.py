"""DualPipeV: DeepSeek's DualPipe cut in half, on a V placement.

DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, Sec. 3.2.1 (DualPipe);
DualPipeV ("cut-in-half" DualPipe, after Sea AI Lab) in the DualPipe
repository, github.com/deepseek-ai/DualPipe.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ..ir import ActionRows, from_rows
from ..ir import F as _F
from ..ir import I as _I
from ..ir import W as _W
from .rank_order import RankOrder
from .registry import register
from .zero_bubble import zb_v_order


@register(
    "dualpipe-v",
    summary="DualPipeV's order (the forward of one stage beside the backward of the other), backward split in I, W",
    paper="DeepSeek-AI, DeepSeek-V3 Technical Report, 2024 (DualPipe, Sec. 3.2.1); "
    "DualPipeV in github.com/deepseek-ai/DualPipe",
    placement="v",
    virtual_stages=(2,),
    default_virtual_stages=2,
    bubble="(p-1)/(6m+p-1) for m >= 2p (F = I = W per stage); zb-v's below",
    memory="p + 1/2 (2p+1 stage activations) for m >= 2p; zb-v's min(p, m) below",
)
def dualpipe_v(p: int, m: int, v: int) -> ActionRows:
    """DualPipeV's order through a V: rank r holds stage r (down) and stage 2p-1-r (up).

    DualPipeV pairs the forward of one of a rank's stages with the backward
    of the other (down F with up B, up F with down B) and runs each pair as
    one overlapped unit. Its order, in eight steps on rank r: 2(p-r-1) down
    forwards; r+1 (down F, up F); p-r-1 (up I, an owed W, up F); m-2p+r+1
    rounds of the two pairs; p-r-1 (up B, then the pair up F + down B); r+1
    rounds of both backwards, from the middle on as I with W owed; p-r-1
    (an owed W, down I); the W passes still owed. Its pairs need m >= 2p;
    with fewer micro-batches this schedule is zb-v. p=2, m=5, free
    transfers (lower case: the down stage, upper case: the up stage)::

        rank 0  f0 f1 f2 F0 I0 W0 F1 f3 I1 W1 F2 i0 w0 f4 I2 W2 F3 i1 w1 I3 W3 F4 i2 w2 I4 W4 i3 w3 .  i4 w4
        rank 1  .  f0 F0 f1 F1 f2 I0 W0 F2 i0 w0 f3 I1 W1 F3 i1 w1 f4 I2 W2 F4 i2 w2 I3 W3 i3 w3 I4 i4 W4 w4

    How it differs from DualPipeV: stagewise's actions run one after the
    other, so a pair is its forward, then its backward; and each full
    backward B is split into I with its W right after it (the simulator
    charges I + W = B, and the input gradient leaves a W earlier). In the
    simulator this is at least as fast as DualPipeV's own order at every
    transfer time (tests/core/test_orders_vs_torch.py); the overlap of a
    pair's two halves, which DualPipeV is built for, is not modelled.

    Makespan with free transfers and F = I = W = 1: 6m+p-1 for m >= 2p, the
    least possible (rank p-1 starts at p-1 and has 6m units of work), as
    zb-v's; rank 0 holds at most 2p+1 stage activations, one more than
    zb-v: what the pairing costs.
    """
    if m < 2 * p:
        return zb_v_order(p, m)
    return ActionRows(from_rows([_dualpipe_v_rank(p, m, r) for r in range(p)]))


def _dualpipe_v_rank(p: int, m: int, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rank r's DualPipeV order (m >= 2p) in its eight steps; each full backward becomes I then W."""
    down, up = r, 2 * p - 1 - r
    o = RankOrder(m)
    owed: deque[tuple[int, int]] = deque()  # W passes of the input gradients DualPipeV runs split

    def input_grad(stage: int) -> None:
        owed.append((stage, o.add(_I, stage)))

    def backward(stage: int) -> None:
        o.add(_W, stage, o.add(_I, stage))

    def weight() -> None:
        if owed:
            o.add(_W, *owed.popleft())

    o.forwards(down, 2 * (p - r - 1))  # 1: the down stage alone
    for _ in range(r + 1):  # 2: both stages' forwards
        o.add(_F, down)
        o.add(_F, up)
    for _ in range(p - r - 1):  # 3: zero-bubble steps on the up stage
        input_grad(up)
        weight()
        o.add(_F, up)
    for _ in range(m - 2 * p + r + 1):  # 4: the main pairs, F of one stage beside B of the other
        o.add(_F, down)
        backward(up)
        o.add(_F, up)
        backward(down)
    for _ in range(p - r - 1):  # 5: the up stage's last backwards beside its last forwards
        backward(up)
        o.add(_F, up)
        backward(down)
    split = False  # 6: both stages' backwards; from the middle on, W is deferred (zero bubble)
    for i in range(r + 1):
        for stage, parity in ((up, 1), (down, 0)):
            if i == (r + 1) // 2 and r % 2 == parity:
                split = True
            (input_grad if split else backward)(stage)
    for _ in range(p - r - 1):  # 7: the down stage's last input gradients, each after an owed W
        weight()
        (input_grad if split else backward)(down)
    while owed:  # 8: the rest of the W passes
        weight()
    return o.columns()
