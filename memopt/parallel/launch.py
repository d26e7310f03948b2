"""Ranks: launching local workers and joining the process group (the groups themselves: dims.py).

``trainer.nproc_per_node=N`` makes ``python -m memopt.train`` start N local workers through
PyTorch's elastic launch API (the machinery behind ``torchrun``): a worker that crashes brings
the others down and the error names the rank and its cause. The same program also runs unchanged
under an external ``torchrun`` (multi-node): then ``WORLD_SIZE`` is already set and no launch happens.
Backends: NCCL on CUDA, gloo on CPU.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from memopt.parallel.dims import ParallelConfig, ParallelDims, build_dims


def under_launcher() -> bool:
    """True inside a worker started by torchrun / elastic launch (or any WORLD_SIZE>1 launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def join(device: torch.device) -> None:
    """Join the process group described by the launcher's environment (none for one process)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=10))


def setup(device: torch.device, parallel: ParallelConfig | None = None) -> ParallelDims:
    """Join the process group and return this rank's ``ParallelDims`` for ``parallel`` (default: all
    data-parallel)."""
    join(device)
    return build_dims(parallel or ParallelConfig(), device.type)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(nproc: int, entrypoint, *args, preloaded: bool = False) -> dict[int, object]:
    """Run ``entrypoint(*args)`` in ``nproc`` local worker processes; returns {rank: return value}.

    Raises ``RankFailure`` naming the failed rank and its error when any worker fails: a rank that crashed in
    native code (``RecordsCrash``) before the one torch's agent recorded, often a peer failing on the connection
    the crashed rank closed.
    ``preloaded``: fork the workers from a server that has imported torch and the trainer once per
    process (``forkserver``), for callers that launch many times (``api.run_jobs_on_ranks``); each worker
    takes the caller's environment, working directory and import path of the moment, as spawned ones do.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if preloaded:
        preload_forkserver()
        entrypoint = InCallersState(entrypoint)
    crash_dir = tempfile.mkdtemp(prefix="memopt-ranks-")
    entrypoint = RecordsCrash(entrypoint, crash_dir)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"memopt-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
        start_method="forkserver" if preloaded else "spawn",
    )
    from torch.distributed.elastic.multiprocessing.api import SignalException

    # the agent logs every worker's failure (a refusal too) as a traceback of its own polling loop and
    # the rank's; memopt says the outcome in one line and prints a rank's traceback only for a crash
    # (its modules' loggers set their own level, so each is quieted, not only the package's)
    prefixes = ("torch.distributed.elastic", "torch.multiprocessing")
    agent_logs = [logging.getLogger(n) for n in (*prefixes, *[n for n in list(logging.root.manager.loggerDict)
                                                             if n.startswith(tuple(p + "." for p in prefixes))])]
    levels = [log.level for log in agent_logs]
    for log in agent_logs:
        log.setLevel(logging.CRITICAL)
    # torch's agent installs its own handlers (raising SignalException) and leaves them behind: the caller's come back
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        return elastic_launch(config, entrypoint)(*args)
    except SignalException as e:  # SIGTERM/SIGINT to this process: the agent has stopped the workers
        from memopt.errors import Interrupted

        raise Interrupted(f"{signal.Signals(e.sigval).name} received by the launcher; its ranks were stopped") from None
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        crashed = _crashed(crash_dir)
        if crashed is not None:  # a peer that failed on the connection it closed may be the one recorded
            crank, sig, dump = crashed
            print(f"rank {crank}:\n{dump.rstrip()}", file=sys.stderr)
            then = f" (rank {rank} then: {_message(failure)})" if crank != rank and _message(failure) else ""
            raise RankFailure(crank, f"died of {sig}, a crash in native code{then}", signal=sig) from None
        msg = failure.message
        if isinstance(msg, dict):
            stack = (msg.get("extraInfo") or {}).get("py_callstack")
            if stack:
                print(f"rank {rank}:\n{stack.rstrip()}", file=sys.stderr)
            msg = msg.get("message", str(msg))
        # no error file (a raised exception writes one) and a code of its own: the rank's recorded status
        clean = failure.exitcode > 0 and not os.path.isfile(failure.error_file)
        cause = f"exit code {failure.exitcode}" if clean or not msg else str(msg).strip().splitlines()[-1]
        raise RankFailure(rank, cause, clean) from None
    finally:
        for log, level in zip(agent_logs, levels):
            log.setLevel(level)
        for s, h in handlers.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        shutil.rmtree(crash_dir, ignore_errors=True)


# faulthandler's first line for each fatal signal it handles
FATAL = {"Segmentation fault": "SIGSEGV", "Bus error": "SIGBUS", "Aborted": "SIGABRT", "Illegal instruction": "SIGILL",
         "Floating-point exception": "SIGFPE"}


class RecordsCrash:
    """A worker's entry point that has ``faulthandler`` write this rank's fatal signal and every thread's stack
    into ``<crash_dir>/rank<r>.txt``: the launcher reads it when the launch fails, since the torch agent records
    only one failed rank, often the peer that failed on the connection the crashed rank closed."""

    def __init__(self, fn, crash_dir: str):
        functools.update_wrapper(self, fn)
        self.fn, self.crash_dir = fn, crash_dir

    def __call__(self, *args):
        import faulthandler

        path = os.path.join(self.crash_dir, f"rank{os.environ.get('RANK', '0')}.txt")
        self._file = open(path, "w")  # kept open: faulthandler writes to its descriptor
        faulthandler.enable(file=self._file, all_threads=True)
        return self.fn(*args)


def _crashed(crash_dir: str) -> tuple[int, str, str] | None:
    """The lowest rank that died of a fatal signal: (rank, signal name, faulthandler's dump in ``crash_dir``)."""
    for name in sorted(os.listdir(crash_dir), key=lambda n: int(n[4:-4])):
        with open(os.path.join(crash_dir, name)) as f:
            dump = f.read()
        first = dump.strip().splitlines()[0] if dump.strip() else ""
        sig = next((v for k, v in FATAL.items() if k in first), None)
        if sig:
            return int(name[4:-4]), sig, dump
    return None


def _message(failure) -> str:
    """A failure's last line of message (its error file's, where it raised)."""
    msg = failure.message
    msg = str((msg.get("message") if isinstance(msg, dict) else msg) or "").strip()
    return msg.splitlines()[-1] if msg else ""


# Why a forkserver: a spawned worker imports torch and the trainer again (~5 s of a 2-rank launch on a 2-core CPU,
# most of a test's launch); forked from a server that imported them once, it starts at once. Only what a fork
# inherits differs from a spawn, so the worker is put back into the caller's state of the moment (below).
# A process has one fork server, which the planner's processes use too (``planner/workers.py``): whichever starts it
# first, it imports what both need (a server without the trainer made every later launch import it, ~5 s each).
PRELOAD = ["torch", "sympy", "memopt.api", "memopt.trainer", "memopt.worker",
           # the planner's (``workers.py``): the search, the simulation, memopt's engines
           "memopt.planner.search", "memopt.planner.preflight", "memopt.planner.extrapolate", "memopt.compose",
           "memopt.checkpoint", "memopt.model_file", "memopt.engines.memopt", "memopt.planner.engines.memopt"]
# what torch's elastic agent sets in each worker's environment (LocalElasticAgent._start_workers), TORCHELASTIC_* too
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                 "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                 "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


def preload_forkserver() -> None:
    """What this process's fork server imports (``PRELOAD``), read when it starts: by the first preloaded launch or
    the planner's first process, whichever comes first."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(PRELOAD)


class InCallersState:
    """A forked worker's entry point: the caller's environment of the moment with what the launcher set for the
    rank (``LAUNCHER_VARS``, ``TORCHELASTIC_*``), the caller's working directory and import path, then ``fn``."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)  # the launcher names (and wraps) its entry point
        self.fn, self.env, self.cwd, self.path = fn, dict(os.environ), os.getcwd(), list(sys.path)

    def __call__(self, *args):
        rank_env = {k: v for k, v in os.environ.items() if k in LAUNCHER_VARS or k.startswith("TORCHELASTIC_")}
        os.environ.clear()
        os.environ.update(self.env)
        os.environ.update(rank_env)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        return self.fn(*args)


class RankFailure(RuntimeError):
    """A rank ended the launch. ``clean``: it exited with a status code of its own after rank 0 recorded
    the outcome (worker._exit_if_recorded), not with a crash or a signal; ``signal``: the crash signal that
    killed it (``FATAL``), None otherwise."""

    def __init__(self, rank: int, cause: str, clean: bool = False, signal: str | None = None):
        super().__init__(f"rank {rank} {cause}" if signal else f"rank {rank} failed: {cause}")
        self.rank, self.cause, self.clean, self.signal = rank, cause, clean, signal
