"""The planner's processes (``planner/workers.py``): forks of a server that imported the planner, not of the
planning process, so they start without importing it again and hold none of that process's state."""
from __future__ import annotations

import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor


def _state() -> tuple:
    """In the worker: the mark the test set in its own process, whether the search's engines and the trainer (what a
    launch from the same server needs) were imported before this task ran (its own module imports neither), and the
    worker's pid."""
    from memopt.planner import workers

    return (getattr(workers, "_mark", None), "memopt.engines.memopt" in sys.modules and "memopt.trainer" in sys.modules,
            os.getpid())


def test_a_planner_process_is_a_fork_of_the_server_that_imported_the_planner(monkeypatch):
    from memopt.planner import workers

    monkeypatch.setattr(workers, "_mark", "set in the planning process", raising=False)
    ctx = workers.context()
    assert ctx.get_start_method() == "forkserver"  # Linux, as CI: a fork server exists
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        mark, preloaded, pid = pool.submit(_state).result()
    assert pid != os.getpid() and mark is None  # not a fork of this process: none of its state
    assert preloaded  # the server imported the planner's engines and the trainer before forking it (one server a
    # process: a launch's workers fork from it too, parallel/launch.py)
    # the control: a spawned process imports only what its task needs
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert pool.submit(_state).result()[:2] == (None, False)


def _env() -> str | None:
    return os.environ.get("MEMOPT_TEST_CALLERS_STATE")


def test_a_planner_process_runs_in_its_callers_environment_of_the_moment(monkeypatch):
    """A fork of the server holds the server's environment of its start (``WORLD_SIZE`` and memopt's own variables
    are read by the planner); the planner's processes are put back into their caller's of now, as spawned ones
    start. The control: without that, the fork reads the server's."""
    from memopt.planner import workers

    monkeypatch.delenv("MEMOPT_TEST_CALLERS_STATE", raising=False)
    ctx = workers.context()
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:  # the server runs from here on, started without it
        assert pool.submit(_env).result() is None
    monkeypatch.setenv("MEMOPT_TEST_CALLERS_STATE", "set after the server started")
    with ProcessPoolExecutor(1, mp_context=ctx, initializer=workers.in_callers_state(_env)) as pool:
        assert pool.submit(_env).result() == "set after the server started"
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        assert pool.submit(_env).result() is None
