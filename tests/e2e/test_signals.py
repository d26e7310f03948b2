"""SIGTERM / SIGINT stop a run at a step boundary: a checkpoint (checkpointing on), summary.json with
status ``interrupted``, exit code 130, and no process left behind; one process and 2 ranks (the
signal goes to the launching process, as a scheduler's would). Both ``slow`` (a CLI run each)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from memopt.errors import EXIT_CODES
from tests.conftest import REPO

QUICK = ["logger=none", "trainer.progress_bar=false", "model=gpt_tiny", "model.seq_len=32", "model.n_layer=2",
         "trainer.micro_batch_size=2", "trainer.eval_every=0", "trainer.log_every=1", "trainer.max_steps=100000",
         "data=synthetic", "data.synthetic_tokens=20000", "trainer.checkpoint_every=100000"]


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    out, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                if ppid == parent:
                    out.append(int(entry))
                    frontier.append(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def interrupt(tmp_path, sig: int, extra: list[str]):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline")
    p = subprocess.Popen([sys.executable, "-m", "memopt.train", f"hydra.run.dir={run}", *QUICK, *extra], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").stat().st_size):
        assert p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.2)
    kids = children(p.pid)
    p.send_signal(sig)
    _, err = p.communicate(timeout=300)
    time.sleep(0.5)
    return p.returncode, err, json.loads((run / "summary.json").read_text()), run, [k for k in kids if alive(k)]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_one_process_with_a_checkpoint(tmp_path, sig):
    code, err, s, run, left = interrupt(tmp_path, sig, [])
    assert code == EXIT_CODES["interrupted"] == 130, err[-3000:]
    assert s["status"] == "interrupted" and signal.Signals(sig).name in s["error"]
    assert s["last_checkpoint"].endswith(f"step_{s['steps_done']}") and os.path.isdir(s["last_checkpoint"])
    assert "trainer.resume=auto" in s["error"] and not left


@pytest.mark.slow
def test_sigterm_stops_two_ranks_with_a_checkpoint(tmp_path):
    code, err, s, run, left = interrupt(tmp_path, signal.SIGTERM, ["trainer.nproc_per_node=2", "+strategy=zero2"])
    assert code == 130, err[-3000:]
    assert s["status"] == "interrupted" and "SIGTERM" in s["error"] and s["world_size"] == 2
    ckpt = s["last_checkpoint"]
    assert len([f for f in os.listdir(ckpt) if f.endswith(".distcp")]) == 2
    assert not left, left  # the ranks (and the launcher's helpers) are gone
    assert "Traceback" not in err


@pytest.mark.slow
def test_sigterm_before_the_ranks_start_their_loop_still_records_interrupted(tmp_path):
    """A SIGTERM while the 2 ranks are still starting (before their signal handlers exist): the
    launcher stops them and writes the summary itself (status interrupted, exit 130), no child left."""
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline")
    p = subprocess.Popen([sys.executable, "-m", "memopt.train", f"hydra.run.dir={run}", *QUICK, "trainer.nproc_per_node=2"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and len(children(p.pid)) < 3:  # the elastic agent's ranks are spawning
        assert p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.05)
    assert not (run / "metrics.jsonl").exists()  # no step yet
    kids = children(p.pid)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    time.sleep(0.5)
    s = json.loads((run / "summary.json").read_text())
    assert p.returncode == EXIT_CODES["interrupted"] == 130, err[-3000:]
    assert s["status"] == "interrupted" and "SIGTERM" in s["error"] and s["engine"] == "memopt"
    assert not [k for k in kids if alive(k)]


@pytest.mark.slow
def test_kill_9_of_the_launcher_is_recorded_as_its_death_with_a_checkpoint(tmp_path):
    """The launcher cannot record its own SIGKILL; its ranks get SIGINT from PyTorch's parent-death signal
    (it was recorded as "SIGINT received twice: stopped inside a step"). They stop together at the step
    boundary with a checkpoint and rank 0 records the launcher's death; no rank is left."""
    code, err, s, run, left = interrupt(tmp_path, signal.SIGKILL, ["trainer.nproc_per_node=2"])
    assert code == -signal.SIGKILL
    assert s["status"] == "interrupted" and "launching process" in s["error"] and "died" in s["error"], s["error"]
    assert "twice" not in s["error"] and os.path.isdir(s["last_checkpoint"]) and not left, left


@pytest.mark.slow
def test_sigint_twice_to_the_launcher_is_recorded_as_the_launchers_signal(tmp_path):
    """Ctrl-C twice at a 2-rank launch: the record names the signal the launcher got (its agent stops the
    ranks with SIGTERM, which they used to report as the cause), with what rank 0 saw beside it."""
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline")
    p = subprocess.Popen([sys.executable, "-m", "memopt.train", f"hydra.run.dir={run}", *QUICK, "trainer.nproc_per_node=2"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").stat().st_size):
        assert p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    s = json.loads((run / "summary.json").read_text())
    assert p.returncode == 130 and s["status"] == "interrupted", err[-3000:]
    assert s["error"].startswith("SIGINT received by the launcher"), s["error"]


@pytest.mark.slow
def test_sigterm_to_the_process_group_stops_two_ranks_with_a_checkpoint(tmp_path):
    """What GNU `timeout` does: SIGTERM to the command, then to its whole process group, so the launcher gets it
    twice and each rank gets it directly and again from the launcher's agent a moment later. One request: the
    ranks finish the step and write the checkpoint (the copies had been read as a second request, which abandons
    the step)."""
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline")
    p = subprocess.Popen([sys.executable, "-m", "memopt.train", f"hydra.run.dir={run}", *QUICK, "trainer.nproc_per_node=2",
                          "+strategy=zero2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").stat().st_size):
        assert p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.2)
    kids = children(p.pid)
    os.kill(p.pid, signal.SIGTERM)
    os.killpg(p.pid, signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    time.sleep(0.5)
    s = json.loads((run / "summary.json").read_text())
    assert p.returncode == 130 and s["status"] == "interrupted", err[-3000:]
    assert "twice" not in s["error"], s["error"]
    assert s["last_checkpoint"] and len([f for f in os.listdir(s["last_checkpoint"]) if f.endswith(".distcp")]) == 2
    assert not [k for k in kids if alive(k)]


@pytest.mark.slow
def test_sigterm_stops_a_sweep_not_only_its_job(tmp_path):
    """A scheduler's SIGTERM to a sweep: the running job stops at a step boundary (interrupted) and the jobs after
    it are not started; the sweep exits 130 (it ran every later job to the end and exited 0)."""
    sweep = tmp_path / "sweep"
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline")
    p = subprocess.Popen([sys.executable, "-m", "memopt.train", "-m", f"hydra.sweep.dir={sweep}", *QUICK,
                          "+strategy=ddp,zero1,zero2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = sweep / "0" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (first.exists() and first.stat().st_size):
        assert p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130, err[-3000:]
    assert json.loads((sweep / "0" / "summary.json").read_text())["status"] == "interrupted"
    assert not (sweep / "1").exists() and not (sweep / "2").exists()


@pytest.mark.slow
def test_sigterm_while_auto_plans_records_interrupted(tmp_path):
    """SIGTERM while +strategy=auto measures the CPU and plans (before any rank): status interrupted, exit 130,
    summary.json written and no process left; SIGTERM's default action had killed the command (exit 143, no record)
    or a probe's broad except had taken it for its own failure and the search went on."""
    run, log = tmp_path / "run", tmp_path / "err.log"
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline")
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "memopt.train", f"hydra.run.dir={run}", *QUICK, "+strategy=auto",
                              "trainer.nproc_per_node=2", "hardware.device_memory_gb=0.01"], env=env,
                             stdout=subprocess.DEVNULL, stderr=err, text=True)
        deadline = time.time() + 300
        while time.time() < deadline and "measuring this CPU" not in log.read_text():
            assert p.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        kids = children(p.pid)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=300)
    time.sleep(0.5)
    s = json.loads((run / "summary.json").read_text())
    assert p.returncode == 130 and s["status"] == "interrupted" and "while planning" in s["error"], log.read_text()[-3000:]
    assert not [k for k in kids if alive(k)] and not [k for k in children(p.pid) if alive(k)]
    # it trained nothing: the command again into that directory (a scheduler's requeue) runs, not "holds a run"
    again = subprocess.run([sys.executable, "-m", "memopt.train", f"hydra.run.dir={run}", *QUICK, "trainer.max_steps=2"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
