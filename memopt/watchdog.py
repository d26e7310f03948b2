"""The watchdog: a rank that makes no progress for ``trainer.watchdog_s`` seconds stops the job, and
the record names the rank and the phase it was in.

Each rank's ``Heartbeat`` keeps its phase (``forward/backward``, ``optimizer step``, ...) and step,
and a daemon thread writes them with the time into ``<run dir>/.watchdog/rank<r>.json`` every
fraction of the timeout. Two ways to stall are told apart:
- the file stops being refreshed: the process is not running (SIGSTOP, swapped out, a hang that
  holds the interpreter), so that rank is named;
- the file is fresh but its phase has not changed: the rank waits. Ranks blocked in a collective
  behind a stalled one entered their phase later, so the rank whose phase is the oldest is named.
  This verdict waits until every rank has reached its first step (building a large model may take
  longer than the timeout); a process that stops is detected in any phase.
``Watchdog`` polls the files: the launching process runs it for its local ranks (and kills them when
it fires); a single process, or rank 0 under an external launcher, runs it in a thread of its own.
"""
from __future__ import annotations

import json
import os
import threading
import time

DIR = ".watchdog"
FINISHED = "finished"  # a rank's last beat: its run is over (whatever its outcome), nothing more to judge
IN_STEP = ("forward/backward", "optimizer step")  # the phases of a step before its optimizer step has finished
WATCHED_BY_LAUNCHER = "MEMOPT_WATCHED_BY_LAUNCHER"  # set by train.py while it watches its local ranks


def _path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, DIR, f"rank{rank}.json")


class Heartbeat:
    """This rank's phase and step, published every ``interval`` seconds by a daemon thread."""

    def __init__(self, run_dir: str, rank: int, interval: float):
        self.path, self.rank, self.interval = _path(run_dir, rank), rank, interval
        self.phase, self.step, self.since = "start", None, time.time()
        self._stop = threading.Event()
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._write()
        self._thread = threading.Thread(target=self._loop, name=f"memopt-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def set(self, phase: str, step: int | None = None) -> None:
        self.phase, self.since = phase, time.time()
        if step is not None:
            self.step = step

    def _write(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"rank": self.rank, "pid": os.getpid(), "phase": self.phase, "step": self.step,
                       "since": self.since, "beat": time.time()}, f)
        os.replace(tmp, self.path)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._write()
            except OSError:
                pass

    def close(self) -> None:
        """Stop beating, with a last beat saying this rank is done: its process still tears down (the process
        group, the logger) before it exits, and a watchdog reading the silence as a hang failed runs that had
        finished."""
        self._stop.set()
        self._thread.join(timeout=self.interval + 1)  # a write stuck on a hung file system must not hold the teardown
        self.phase, self.since = FINISHED, time.time()
        try:
            self._write()
        except OSError:
            pass


def read_beats(run_dir: str) -> dict[int, dict]:
    out = {}
    d = os.path.join(run_dir, DIR)
    for name in os.listdir(d) if os.path.isdir(d) else []:
        if name.startswith("rank") and name.endswith(".json"):
            try:
                with open(os.path.join(d, name)) as f:
                    b = json.load(f)
                out[int(b["rank"])] = b
            except (OSError, ValueError, KeyError):
                continue
    return out


def find_stall(beats: dict[int, dict], timeout: float, now: float | None = None) -> tuple[int, str] | None:
    """(rank, message) of the rank to blame, or None while every rank progresses."""
    now = time.time() if now is None else now
    beats = {r: b for r, b in beats.items() if b.get("phase") != FINISHED}
    where = lambda b: f"in phase '{b['phase']}'" + (f" of step {b['step']}" if b.get("step") is not None else "")  # noqa: E731
    silent = [b for b in beats.values() if now - b["beat"] > timeout]
    if silent:
        b = min(silent, key=lambda b: b["beat"])
        return b["rank"], (f"watchdog: rank {b['rank']} (pid {b['pid']}) stopped responding {now - b['beat']:.0f} s ago "
                           f"{where(b)}: its process is not running (stopped or hung) (trainer.watchdog_s={timeout:g})")
    if any(b.get("step") is None for b in beats.values()):
        return None  # a rank is still building (its length is not bounded by the timeout): no verdict on waiting
    waiting = [b for b in beats.values() if now - b["since"] > timeout]
    if waiting:
        b = min(waiting, key=lambda b: b["since"])
        return b["rank"], (f"watchdog: rank {b['rank']} (pid {b['pid']}) made no progress for {now - b['since']:.0f} s "
                           f"{where(b)} (trainer.watchdog_s={timeout:g})")
    return None


class Watchdog:
    """Polls the heartbeats of ``run_dir``; calls ``on_stall(rank, message, beats)`` once when one stalls."""

    def __init__(self, run_dir: str, timeout: float, on_stall):
        self.run_dir, self.timeout, self.on_stall = run_dir, timeout, on_stall
        self.fired: tuple[int, str] | None = None
        self.beats: dict[int, dict] = {}  # the heartbeats it fired on
        self.started = time.time()  # heartbeats older than this are a previous run's leftovers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memopt-watchdog", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            beats = {r: b for r, b in read_beats(self.run_dir).items() if b["beat"] >= self.started}
            found = find_stall(beats, self.timeout) if beats else None
            if found is not None:
                self.fired, self.beats = found, beats
                self.on_stall(*found, beats)
                return

    def close(self) -> None:
        self._stop.set()

    def steps_done(self) -> int | None:
        """Steps every rank had finished when it fired, from the heartbeats (None before the first step):
        a rank in step k's forward, backward or optimizer step has finished k; after its optimizer step
        (the loss all-reduce, the evaluation, the step boundary, a checkpoint save), k + 1."""
        done = [b["step"] + (b.get("phase") not in IN_STEP) for b in self.beats.values() if b.get("step") is not None]
        return min(done) if done else None
