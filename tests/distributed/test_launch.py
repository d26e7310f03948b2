"""Launching ranks: trainer.nproc_per_node, external torchrun, crashes, sweeps of N-rank jobs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

QUICK = ["logger=none", "trainer.max_steps=3", "trainer.eval_every=0", "trainer.progress_bar=false", "trainer.micro_batch_size=2"]


def run(args, cwd, env_extra=None, module=("-m", "memopt.train")):
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, *module, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_nproc_per_node_runs_ranks_into_one_directory(tmp_path):
    d = tmp_path / "r"
    p = run([f"hydra.run.dir={d}", "trainer.nproc_per_node=2", "+strategy=zero2", *QUICK, "trainer.save_checkpoint=true"], str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "ok" and s["world_size"] == 2 and set(s["peak_bytes"]) == {"0", "1"} and set(s["peak_rss_bytes"]) == {"0", "1"}
    assert (d / "model.pt").exists() and len((d / "metrics.jsonl").read_text().splitlines()) >= 2
    assert sorted(os.listdir(tmp_path)) == ["r"]  # no stray per-rank directories


def test_a_crashing_rank_stops_the_job_and_is_named(tmp_path):
    d = tmp_path / "r"
    p = run([f"hydra.run.dir={d}", "trainer.nproc_per_node=2", *QUICK], str(tmp_path), {"MEMOPT_FAULT_RANK": "1"})
    assert p.returncode == 1  # memopt.errors.EXIT_CODES["failed"]
    assert "rank 1 failed" in p.stderr and "injected fault" in p.stderr
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "failed" and s["failed_rank"] == 1 and "injected fault" in s["error"]
    assert s["engine"] == "memopt" and s["strategy"] == [] and s["world_size"] == 2  # what the job was asked to run


def test_a_rank_over_its_budget_alone_ends_the_job_oom_naming_it(tmp_path):
    """Rank 1 crosses its device budget at build while rank 0 waits for it in a collective (it then fails on
    the closed connection, not on memory): the job ends ``oom`` (exit 3) with rank 1's own reason, the
    budget crossing and its category, not ``failed`` with rank 0's gloo error."""
    d = tmp_path / "r"
    p = run([f"hydra.run.dir={d}", "trainer.nproc_per_node=2", "hardware.device_memory_gb=4", *QUICK], str(tmp_path),
            {"MEMOPT_FAULT_BUDGET": "1:65536"})
    assert p.returncode == 3, p.stderr[-3000:]  # memopt.errors.EXIT_CODES["oom"]
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "oom" and s["failed_rank"] == 1, s
    assert s["error"].startswith("rank 1: DeviceBudgetExceeded") and "65536" in s["error"] and "crossed by" in s["error"]
    assert "rank 1" in p.stderr.splitlines()[-1] and "oom" in p.stderr.splitlines()[-1]


@pytest.mark.slow  # 5 s; a launch of 2 ranks runs by default (nproc_per_node)
def test_runs_unchanged_under_torchrun(tmp_path):
    d = tmp_path / "r"
    p = run(["--standalone", "--nproc_per_node=2", "-m", "memopt.train", f"hydra.run.dir={d}", "+strategy=zero3", *QUICK],
            str(tmp_path), module=("-m", "torch.distributed.run"))
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "ok" and s["world_size"] == 2 and set(s["peak_bytes"]) == {"0", "1"}


@pytest.mark.slow  # 25 s; the default suite sweeps single-rank jobs (tests/report) and launches 2 ranks here
def test_multirun_sweep_of_two_rank_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    p = run(["-m", f"hydra.sweep.dir={sweep}", "trainer.nproc_per_node=2", "+strategy=zero1,zero3", *QUICK], str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    summaries = [json.loads((sweep / j / "summary.json").read_text()) for j in sorted(os.listdir(sweep)) if (sweep / j / "summary.json").exists()]
    assert sorted(tuple(s["strategy"]) for s in summaries) == [("zero1",), ("zero3",)]
    assert all(s["status"] == "ok" and s["world_size"] == 2 for s in summaries)


@pytest.mark.slow  # 13 s; the warning itself is raised in the default suite (test_strategy_effects: cpu_offload)
def test_zero_stage_on_one_rank_degrades_as_documented(tmp_path):
    from tests.conftest import losses, train

    base = ["trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0", "trainer.micro_batch_size=4"]

    with pytest.warns(UserWarning, match="zero2 on one rank partitions nothing"):
        train(base + ["+strategy=zero2"], str(tmp_path / "a"))
    train(base, str(tmp_path / "b"))
    assert losses(str(tmp_path / "a")) == losses(str(tmp_path / "b"))


def _rank_state(name: str) -> tuple:
    return os.environ.get(name), os.getcwd(), os.environ["RANK"]


def test_preloaded_workers_take_the_callers_environment_and_directory(tmp_path, monkeypatch):
    """``api.run_jobs_on_ranks`` forks its workers from a server that imported torch once (``launch(preloaded=True)``);
    a fork inherits the server's state, so each worker is put back into the caller's: a variable set, one removed and
    the directory changed after the server started reach the ranks of the next launch, as a spawn's would."""
    from memopt.parallel import launch

    monkeypatch.setenv("MEMOPT_LAUNCH_GONE", "server")
    launch(2, _rank_state, "MEMOPT_LAUNCH_GONE", preloaded=True)  # the server starts here at the latest
    monkeypatch.setenv("MEMOPT_LAUNCH_PROBE", "caller")
    monkeypatch.delenv("MEMOPT_LAUNCH_GONE")
    monkeypatch.chdir(tmp_path)
    got = launch(2, _rank_state, "MEMOPT_LAUNCH_PROBE", preloaded=True)
    assert got == {0: ("caller", str(tmp_path), "0"), 1: ("caller", str(tmp_path), "1")}
    assert set(launch(2, _rank_state, "MEMOPT_LAUNCH_GONE", preloaded=True).values()) == \
        {(None, str(tmp_path), "0"), (None, str(tmp_path), "1")}


def test_a_launch_gives_the_callers_signal_handlers_back():
    """torch's agent installs handlers that raise its SignalException and leaves them: a SIGTERM after one of
    +strategy=auto's trials, while the search went on planning, was taken for the next trial's failure. The
    caller's handlers are in place after a launch."""
    import signal

    from memopt.parallel import launch

    def mine(signum, frame):
        pass

    previous = {s: signal.signal(s, mine) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        launch(2, _rank_state, "MEMOPT_LAUNCH_PROBE", preloaded=True)
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGINT) is mine
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _segfault_on_rank1() -> None:
    import signal

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.all_reduce(torch.ones(1))  # rank 0: its peer's connection closes under it


@pytest.mark.parametrize("preloaded", [True, False], ids=["forked", "spawned"])
def test_a_rank_that_crashes_in_native_code_is_named_before_the_peer_it_broke(preloaded):
    """A segfault in a rank (torch's or gloo's native code) leaves its peer failing on a closed connection,
    often recorded earlier than the crash: the launch names the crashed rank and its signal, and the error
    says it (the test suite reruns a test once on such a crash, ``make test``)."""
    from memopt.parallel import RankFailure, launch

    with pytest.raises(RankFailure) as e:
        launch(2, _segfault_on_rank1, preloaded=preloaded)
    assert e.value.rank == 1 and e.value.signal == "SIGSEGV", str(e.value)
    assert str(e.value).startswith("rank 1 died of SIGSEGV, a crash in native code"), str(e.value)
