"""Launching local ranks with torch's own launcher (``torch.distributed.run``), for ``stagewise run``.

Ctrl-C (SIGINT) ends the job with one line and exit status 130 (:mod:`stagewise.runtime.interrupt`): the
launcher takes SIGINT itself rather than leaving it to torch's agent (whose shutdown logs a warning per
worker and whose exception ends in a traceback), raises the agent's own ``SignalException`` so that the agent
forwards SIGINT to every worker and waits for them, quiets the agent's shutdown messages, then prints where
the workers stopped. SIGTERM (what a scheduler, SLURM or Kubernetes, sends to stop a job) is taken the same
way: the workers get SIGINT, the one line says "stopped by SIGTERM", the exit status is 143. SIGHUP and SIGQUIT
stay torch's.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from types import FrameType
from typing import Any

from .interrupt import FOLDER_ENV, first_cause, records, summary

#: the signals torch's agent keeps handling: torchrun's --signals-to-handle, through its environment variable
#: (PET_ + the option: a torch without the option ignores it, and keeps SIGINT: a traceback, as before)
_TORCH_SIGNALS = {"PET_SIGNALS_TO_HANDLE": "SIGHUP,SIGQUIT"}
#: the signals the launcher takes itself: each stops the workers as Ctrl-C does
_TAKEN = (signal.SIGINT, signal.SIGTERM)


def torchrun(
    argv: list[str],
    env: dict[str, str] | None = None,
    explain: Callable[[BaseException], str] | None = None,
    watch: Callable[[str], AbstractContextManager[None]] | None = None,
) -> int:
    """Hand over to ``torch.distributed.run``; returns the exit status (1 when a child failed, 130 on Ctrl-C, 143 on
    SIGTERM).

    ``env``: variables for torch's agent and the workers (``--nnodes MIN:MAX``: :mod:`.elastic.launch`);
    ``explain``: what a failed rendezvous means, printed as one line (exit status 1) instead of a traceback;
    ``watch``: around the agent's run, given the folder of the workers' records (:func:`.elastic.launch.watched`).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import main as torchrun_main

    hush = _Hush()
    extra = {**_TORCH_SIGNALS, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="stagewise-run-") as folder:
        saved = {k: os.environ.get(k) for k in (FOLDER_ENV, *extra)}
        os.environ[FOLDER_ENV] = folder  # the workers inherit it: where they say where they stopped
        os.environ.update(extra)
        previous = {sig: signal.signal(sig, hush.interrupt(SignalException)) for sig in _TAKEN}
        hush.attach()
        watching = watch(folder) if watch is not None else nullcontext()
        try:
            with watching:
                torchrun_main(argv)
        except ChildFailedError as err:
            print(f"stagewise run: {str(err).strip()}", file=sys.stderr)  # (torch's text starts on a new line)
            cause = first_cause(folder)  # last, where the eye lands: which rank failed, where, with what
            if cause is not None:
                print(f"stagewise run: {cause}", file=sys.stderr, flush=True)
            return 1
        except RendezvousError as err:  # (--nnodes MIN:MAX) fewer machines than MIN, or the store is gone
            if explain is None:
                raise
            print(f"stagewise run: {explain(err)}", file=sys.stderr, flush=True)
            return 1
        except SignalException as err:
            if err.sigval != signal.SIGINT or hush.received is None:
                raise
            print(summary(records(folder), hush.received.name), file=sys.stderr, flush=True)
            return 128 + int(hush.received)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            hush.detach()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return 0


class _Hush(logging.Filter):
    """Once Ctrl-C arrived, drop what torch's launcher logs while it shuts the workers down ("Received
    SIGINT death signal", "Sending process ... closing signal", one per worker)."""

    LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")

    def __init__(self) -> None:
        super().__init__()
        self.stopping = False
        self.received: signal.Signals | None = None  # the signal that stopped the job
        self._on: list[logging.Logger] = []

    def interrupt(self, raise_as: type[Exception]) -> Any:
        """The SIGINT / SIGTERM handler: the agent's own signal exception for SIGINT, once, which the agent
        forwards to the workers (their Ctrl-C: each says where it stopped and leaves the ordinary way); a second
        signal while they are leaving is ignored: raising again would abandon them mid-shutdown."""

        def handler(signum: int, frame: FrameType | None) -> None:
            if self.stopping:
                return
            self.stopping = True
            self.received = signal.Signals(signum)
            raise raise_as(f"Process {os.getpid()} got signal: {signum}", sigval=signal.SIGINT)  # type: ignore[call-arg]

        return handler

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.stopping

    def attach(self) -> None:
        """On every logger of torch's launcher (a logger's filters see its own records only)."""
        names = [n for n in logging.root.manager.loggerDict if n.startswith(self.LOGGERS)]
        self._on = [logging.getLogger(n) for n in names]
        for logger in self._on:
            logger.addFilter(self)

    def detach(self) -> None:
        for logger in self._on:
            logger.removeFilter(self)
        self._on = []
