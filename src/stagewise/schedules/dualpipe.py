"""DualPipeV: DeepSeek's DualPipe cut in half, on a V placement.

DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, Sec. 3.2.1 (DualPipe);
DualPipeV ("cut-in-half" DualPipe, after Sea AI Lab) in the DualPipe
repository, github.com/deepseek-ai/DualPipe.
"""

from __future__ import annotations

from ..ir import ActionRows
from .registry import register
from .zero_bubble import v_wave


@register(
    "dualpipe-v",
    summary="DualPipeV's micro-batch pairing (forward of k+p with the backward of k) as a zero-slack V wave",
    paper="DeepSeek-AI, DeepSeek-V3 Technical Report, 2024 (DualPipe, Sec. 3.2.1); "
    "DualPipeV in github.com/deepseek-ai/DualPipe",
    placement="v",
    virtual_stages=(2,),
    default_virtual_stages=2,
    bubble="(p-1)/(6m+p-1) for m >= p (F = I = W per stage)",
    memory="min(p+1, m) (2p+2 stage activations)",
)
def dualpipe_v(p: int, m: int, v: int) -> ActionRows:
    """One direction of micro-batches through a V: rank r holds stage r and stage 2p-1-r.

    DualPipeV's steady state pairs the forward of micro-batch k+p on one
    stage of a rank with the backward of micro-batch k on the other stage
    (F0 with B1, F1 with B0), so that the two run overlapped. This schedule
    keeps that pairing, ``v_wave(p, m, warmup=p)``, and holds at most p+1
    micro-batches (2p+2 stage activations) on a rank; DualPipeV's own order,
    timed by the simulator, peaks at 2p+1. p=3, m=5 (lower case: the rank's
    stage on the way down, upper case: its stage on the way back)::

        rank 0  f0 f1 f2 .  .  F0 f3 F1 I0 F2 W0 F3 f4 i0 I1 w0 I2 F4 I3 i1 I4 i2 W1 i3 W2 i4 W3 w1 W4 w2 w3 w4
        rank 1  .  f0 f1 .  F0 f2 F1 f3 F2 I0 F3 W0 i0 f4 w0 I1 F4 I2 i1 I3 i2 I4 i3 W1 i4 W2 w1 W3 w2 W4 w3 w4
        rank 2  .  .  f0 F0 f1 F1 f2 F2 f3 F3 I0 i0 W0 w0 f4 F4 I1 i1 I2 i2 I3 i3 I4 i4 W1 w1 W2 w2 W3 w3 W4 w4

    Makespan 6m+p-1 for m >= p (bubble (p-1)/(6m+p-1)), the same as zb-v;
    for m < p the two schedules are identical.

    How it differs from DualPipeV: (1) DualPipeV runs a pair as one
    overlapped unit whose receives are all posted before it and whose sends
    after it; stagewise's actions are sequential and its communication pass
    puts a batch between the two halves. Both halves of a pair send the
    same way (F0 and B1 both feed rank r+1, F1 and B0 both feed rank r-1),
    and from one rank to the next each pair moves one pair later relative to
    the pairs going the other way, so neighbouring pairs cross in four
    places of which only two can be posted in one batch: under rendezvous
    point-to-point the pairs deadlock. Here the two halves of a pair start
    two time units apart, with a W or an action of the other direction
    between them. (2) DualPipeV's warm-up runs 2(p-r-1)+r+1 first-stage forwards on
    rank r before its first backward, a different count per rank, which
    breaks the order in which a link's messages match; here every rank runs
    p. (3) DualPipeV uses full backward B in its steady state; without the
    overlap that only delays the gradient, so this schedule splits every
    backward into I and W and fills the gaps with W.

    How it differs from zb-v: one more micro-batch in flight (zb-v pairs
    the forward of k+p-1 with the backward of k). With free communication
    the two have the same bubble and zb-v needs less memory; the extra depth
    is what DualPipeV's overlap of a forward with a backward needs, which
    the simulator does not model.
    """
    return v_wave(p, m, warmup=p)
