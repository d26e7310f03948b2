"""The start method of the planner's own processes: forked from a server that imported the planner once.

Why: a spawned process imports torch and the planner before its first task: the search's workers ~3.7-4.7 s on 2
cores before their first plans (measured, 2026-11-28), and the CPU probe of gloo's collectives spawns two more. A
fork server (``multiprocessing``'s "forkserver") imports them once, in its own process, and forks each process from
that: the search's first two plans came back 1.3-1.6 s after its pool was made, against 3.8-4.7 s spawned. Each is
still a fresh interpreter's state (a fork of the server, not of the planning process: no threads, none of the
probes' allocations), as the ranks of a run are. The server starts on first use (the gloo probe, before the
search), not earlier: beside this CPU's product and op probes its imports moved their readings. A fork holds the
server's environment of its start (``multiprocessing`` gives it the caller's directory and import path, not its
environment), so each process's entry is put back into its caller's of the moment (``in_callers_state``, as a
launch's ranks are: the planner reads ``WORLD_SIZE``, ``parallel.dims.expected_world``, as a spawned process would).
Where there is no fork server (Windows), spawn.
"""
from __future__ import annotations

import multiprocessing


def context():
    """The ``multiprocessing`` context the planner's processes start with (module docstring). The process's one fork
    server imports what a plan needs beside what a launch does (``parallel.launch.PRELOAD``, for either's use)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    from memopt.parallel.launch import preload_forkserver

    preload_forkserver()
    return multiprocessing.get_context("forkserver")


def in_callers_state(fn):
    """``fn`` run in this process's environment, directory and import path of now (``parallel.launch.InCallersState``)
    where the planner's processes are forks of the server; as it is where they are spawned (they start with them)."""
    from memopt.parallel.launch import InCallersState

    return InCallersState(fn) if context().get_start_method() == "forkserver" else fn
