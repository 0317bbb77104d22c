"""Two "machines" for real: two torchrun agents in two Linux network namespaces joined by a veth pair.

Each namespace has only ``lo`` and its end of the veth (10.231.0.1 and
10.231.0.2), so every byte between the machines crosses the veth, as between
two hosts. ``stagewise run --nnodes 2 --node-rank I --rdzv-endpoint
10.231.0.1:29500 --local-addr ADDR`` starts two processes in each (c10d
rendezvous, ``GLOO_SOCKET_IFNAME`` naming the namespace's veth), four pipeline
stages over both machines (tests/system/scripts/multinode_train.py); the losses and
parameters after three AdamW steps must equal the one-process model's in
float64 to rounding, and ``transport="auto"`` must have chosen torch/gloo (the
ranks are not all on one host: other namespaces). Needs root (``ip netns``):
skipped with the reason where not permitted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

import multinode_train as mt
import stagewise as sw
from helpers import models as mdl

ADDRS = ("10.231.0.1", "10.231.0.2")
PORT = 29500
RTOL = 1e-10


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def machines() -> Iterator[list[tuple[str, str]]]:
    """Two namespaces (name, veth) joined by a veth pair, made here and always deleted."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2): cannot make network namespaces")
    tag = f"{os.getpid() % 100000}"
    spaces = [(f"swmn{tag}a", f"swv{tag}a"), (f"swmn{tag}b", f"swv{tag}b")]
    made: list[str] = []
    try:
        for name, _ in spaces:
            _ip("netns", "add", name)
            made.append(name)
    except (subprocess.CalledProcessError, OSError) as err:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        reason = getattr(err, "stderr", "") or str(err)
        pytest.skip(f"`ip netns add` is not permitted here (needs root or CAP_SYS_ADMIN): {reason.strip()}")
    try:
        _ip("link", "add", spaces[0][1], "type", "veth", "peer", "name", spaces[1][1])
        for (name, veth), addr in zip(spaces, ADDRS, strict=True):
            _ip("link", "set", veth, "netns", name)
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", veth)
            _ip("-n", name, "link", "set", veth, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield spaces
    finally:
        for name in made:  # deleting a namespace deletes its end of the veth, and with it the pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def rows(machines: list[tuple[str, str]], tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("multinode")
    jobs = []
    for i, ((name, veth), addr) in enumerate(zip(machines, ADDRS, strict=True)):
        cmd = [
            "ip",
            "netns",
            "exec",
            name,
            "env",
            f"GLOO_SOCKET_IFNAME={veth}",
            sys.executable,
            "-m",
            "stagewise.cli.main",
        ]
        cmd += ["run", "-n", "2", "--nnodes", "2", "--node-rank", str(i), "--rdzv-endpoint", f"{ADDRS[0]}:{PORT}"]
        cmd += ["--local-addr", addr, mt.__file__, "--out", str(out)]
        log = open(out / f"machine{i}.log", "w")  # noqa: SIM115 (closed with the process)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        jobs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    codes = []
    for job in jobs:
        try:
            codes.append(job.wait(timeout=240))
        except subprocess.TimeoutExpired:
            job.kill()
            codes.append(job.wait())
    if codes != [0, 0]:
        logs = "\n".join(f"--- machine {i} ---\n{(out / f'machine{i}.log').read_text()[-4000:]}" for i in range(2))
        pytest.fail(f"the two machines exited {codes}:\n{logs}")
    found = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]
    return [{**row, "ckpt": out / "ckpt"} for row in found]


def test_two_machines_in_two_namespaces(rows: list[dict]) -> None:
    assert [row["world"] for row in rows] == [4] * 4
    spaces = [row["netns"] for row in rows]
    assert spaces[0] == spaces[1] != spaces[2] == spaces[3], spaces  # ranks 0-1 on one machine, 2-3 on the other
    assert spaces[0] != os.readlink("/proc/self/ns/net")
    assert [row["transport"] for row in rows] == ["TorchTransport"] * 4  # auto: not one host, so torch/gloo


def test_parity_with_one_process(rows: list[dict]) -> None:
    ref = sw.build_model(mt.layers(), seed=mt.SEED)
    opt = mt.adamw(list(ref.parameters()))
    losses = []
    for step in range(mt.STEPS):
        x, y = mdl.lm_data(mt.BATCH, seed=100 + step)
        loss = mdl.lm_loss(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    for row in rows:
        torch.testing.assert_close(torch.tensor(row["losses"]), torch.tensor(losses), rtol=RTOL, atol=0)
    trained = sw.build_model(mt.layers(), seed=0)
    sw.checkpoint.load(rows[0]["ckpt"], trained, collective=False)
    got = dict(trained.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p, rtol=RTOL, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
