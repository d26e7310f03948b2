"""What stops a run on purpose between two steps: divergence and SIGTERM / SIGINT.

Both decide at a step boundary, identically on every rank (the loss is the data-parallel mean and
the skip is voted; a signal is agreed with one all-reduce of a flag), so no rank is left waiting in
a collective that another rank will never join.
"""
from __future__ import annotations

import math
import os
import signal
import threading
import time

import torch

from memopt.errors import Diverged, Interrupted


class DivergenceGuard:
    """Counts consecutive bad steps (non-finite loss, or an fp16 step the loss scaler skipped) and
    raises ``Diverged`` when there are ``limit`` of them (0: never)."""

    def __init__(self, limit: int, bad: int = 0):
        self.limit, self.bad = limit, bad  # bad: the count a resumed run carries over from its checkpoint

    def update(self, step: int, loss: float, skipped: bool) -> None:
        self.bad = self.bad + 1 if (not math.isfinite(loss) or skipped) else 0
        if self.limit and self.bad >= self.limit:
            what = "non-finite losses or skipped fp16 steps" if math.isfinite(loss) or skipped else "non-finite losses"
            raise Diverged(f"the run diverged: {self.bad} consecutive steps with {what} up to step {step} (last loss "
                           f"{loss}); lower optim.lr, raise optim.warmup_steps or trainer.divergence_steps")


def all_finite(tensors) -> bool:
    """True when no floating tensor (a DTensor: its local shard) holds a NaN or an infinity. By the
    extremes (NaN propagates into them), so the check allocates two scalars, not a mask the size of
    the tensor (``isfinite`` costs several: it runs on the final weights of the whole model)."""
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.is_floating_point() and t.numel():
            lo, hi = torch.aminmax(t)
            if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
                return False
    return True


def parent_gone(pid: int) -> bool:
    """The process ``pid`` (this one's parent when it started) has exited: this process was re-parented,
    or (Linux) ``pid`` is a zombie its own parent has not reaped yet, the state the parent-death signal
    finds it in."""
    if os.getppid() != pid:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


class StopSignals:
    """SIGTERM / SIGINT set a flag that the loop reads at the next step boundary (a second signal
    stops at once); the previous handlers come back on exit. Only the main thread can install them.

    A rank started by a launcher (torch elastic: memopt's own ``trainer.nproc_per_node`` launch or
    torchrun) gets SIGINT from PyTorch's parent-death signal when its launcher dies (kill -9): then its
    parent pid has changed, the stop is recorded as the launcher's death (``orphaned``), and more
    signals of that one event do not abandon the step (the ranks still stop together at the boundary,
    with a checkpoint when they are on).

    Signals within ``SAME_REQUEST_S`` of the first are copies of that one request, not a second: GNU
    ``timeout`` and a terminal's job control signal the whole process group, so a rank gets the signal directly
    and again from its launcher's agent, which forwards what it got a moment later."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    SAME_REQUEST_S = 1.0

    def __init__(self):
        self.signum = 0
        self.orphaned = False
        self._first_at = 0.0  # monotonic time of the first signal
        self._previous: dict = {}
        self._parent = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else None

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self._parent is not None and parent_gone(self._parent):  # the launcher is gone
            self.orphaned = True
            self.signum = self.signum or signum
            return
        now = time.monotonic()
        if self.signum:
            if now - self._first_at < self.SAME_REQUEST_S:  # a copy of the first (process group + launcher)
                return
            raise Interrupted(f"{signal.Signals(signum).name} received twice: stopped inside a step")  # asked again
        self.signum, self._first_at = signum, now

    def describe(self, signum: int) -> str:
        """What stopped the run, for its record."""
        name = signal.Signals(signum).name
        if self.orphaned:
            return f"the launching process (pid {self._parent}) died ({name} from the parent-death signal)"
        return f"{name} received"

    def agreed(self, world, device) -> int:
        """The signal number any rank received (0: none), the same on every rank."""
        if not world.enabled:
            return self.signum
        flag = torch.tensor(float(self.signum), device=device)
        world.all_reduce_(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag.item())
