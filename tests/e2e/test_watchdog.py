"""The watchdog: a rank stopped with SIGSTOP is named (rank, phase) and the job stops within
``trainer.watchdog_s`` instead of hanging until the collective timeout (``slow``: a 2-rank CLI run).
The verdict rules themselves are unit-tested on fabricated heartbeats."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from memopt.watchdog import find_stall
from tests.conftest import REPO

QUICK = ["logger=none", "trainer.progress_bar=false", "model=gpt_tiny", "model.seq_len=32", "model.n_layer=2",
         "trainer.micro_batch_size=2", "trainer.eval_every=0", "trainer.log_every=1", "trainer.max_steps=100000",
         "data=synthetic", "data.synthetic_tokens=20000"]


def beat(rank, phase, step, since, last):
    return {"rank": rank, "pid": 100 + rank, "phase": phase, "step": step, "since": since, "beat": last}


def test_verdicts_name_the_stopped_or_the_oldest_waiting_rank():
    now = 1000.0
    ok = {0: beat(0, "optimizer step", 3, now - 1, now), 1: beat(1, "forward/backward", 3, now - 2, now)}
    assert find_stall(ok, 5, now) is None
    stopped = {**ok, 1: beat(1, "forward/backward", 3, now - 9, now - 9)}
    rank, msg = find_stall(stopped, 5, now)
    assert rank == 1 and "stopped responding" in msg and "'forward/backward' of step 3" in msg
    waiting = {0: beat(0, "loss all-reduce", 7, now - 6, now), 1: beat(1, "evaluation", 7, now - 8, now)}
    rank, msg = find_stall(waiting, 5, now)
    assert rank == 1 and "made no progress for 8 s" in msg and "'evaluation'" in msg
    building = {0: beat(0, "forward/backward", 0, now - 60, now), 1: beat(1, "build", None, now - 70, now)}
    assert find_stall(building, 5, now) is None  # no waiting verdict while a rank still builds
    # a rank whose run is over tears down for a while: not a hang (it failed runs that had finished)
    finished = {0: beat(0, "finished", 3, now - 9, now - 9), 1: beat(1, "finished", 3, now - 8, now - 8)}
    assert find_stall(finished, 5, now) is None
    rank, _ = find_stall({**finished, 1: beat(1, "evaluation", 3, now - 9, now - 9)}, 5, now)
    assert rank == 1  # a rank still in its run is judged beside a finished one


def test_steps_done_when_it_fired_counts_what_every_rank_finished():
    """A rank in step k's forward, backward or optimizer step has finished k steps; after its optimizer
    step (all-reduce, evaluation, boundary, save), k + 1; the job has finished what every rank has."""
    from memopt.watchdog import Watchdog

    w = Watchdog.__new__(Watchdog)
    w.beats = {0: beat(0, "step boundary (signal vote)", 7, 0, 0), 1: beat(1, "optimizer step", 7, 0, 0)}
    assert w.steps_done() == 7
    w.beats = {0: beat(0, "checkpoint save", 7, 0, 0), 1: beat(1, "loss all-reduce", 7, 0, 0)}
    assert w.steps_done() == 8
    w.beats = {0: beat(0, "build", None, 0, 0)}
    assert w.steps_done() is None


@pytest.mark.slow
def test_sigstop_on_one_rank_stops_the_job_naming_it(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline")
    p = subprocess.Popen([sys.executable, "-m", "memopt.train", f"hydra.run.dir={run}", *QUICK, "trainer.nproc_per_node=2",
                          "trainer.watchdog_s=5"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    beats = run / ".watchdog"
    deadline, pid = time.time() + 300, None
    while time.time() < deadline and pid is None:
        assert p.poll() is None, p.communicate()[1][-3000:]
        try:
            b = {r: json.loads((beats / f"rank{r}.json").read_text()) for r in (0, 1)}
            if all((x.get("step") or 0) >= 1 for x in b.values()):
                pid = b[1]["pid"]
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    t0 = time.time()
    _, err = p.communicate(timeout=120)
    assert time.time() - t0 < 60  # within the timeout plus teardown, not the 10-minute collective timeout
    s = json.loads((run / "summary.json").read_text())
    assert p.returncode == 1 and s["status"] == "failed", err[-3000:]
    assert s["stalled_rank"] == 1 and "rank 1" in s["error"] and "stopped responding" in s["error"] and "phase" in s["error"]
    assert isinstance(s["steps_done"], int) and s["steps_done"] >= 1  # from the heartbeats: the ranks were killed
    last = err.strip().splitlines()[-1]
    assert "Stalled" in last and "rank 1" in last and "SIGKILL" not in last, last  # the cause, not the kill
    time.sleep(0.5)
    for r in (0, 1):
        assert not os.path.exists(f"/proc/{json.loads((beats / f'rank{r}.json').read_text())['pid']}"), r
