"""A sweep whose every job fails exits non-zero, and its report still names each job's engine,
strategies and status."""
from __future__ import annotations

import os

import pytest

from tests.report.helpers import QUICK, Tables, run_module, summaries, table_by_header


@pytest.mark.slow  # 10 s on an AVX2 CPU; a sweep surviving a failed job stays in the default suite (tests/e2e/test_cli.py)
def test_sweep_where_every_job_fails_exits_nonzero(tmp_path):
    """Job 0: a 2-rank job whose rank 1 dies at start-up (before any trainer wrote engine/strategy);
    job 1: refused. Both appear with the engine and strategies they were asked to run."""
    sweep = str(tmp_path / "allbad")
    proc = run_module("memopt.train", ["-m", f"hydra.sweep.dir={sweep}", "logger=none", *QUICK, "trainer.nproc_per_node=2",
                                       "engine=memopt", "+strategy=zero3,[zero1,zero2]"], cwd=str(tmp_path),
                      MEMOPT_FAULT_RANK="1")
    assert proc.returncode != 0
    assert "every job of the sweep failed" in proc.stderr
    jobs = summaries(sweep)
    assert sorted(s["status"] for s in jobs.values()) == ["failed", "refused"]
    with open(os.path.join(sweep, "report.html")) as f:
        rows = {r["job"][0]: r for r in table_by_header(Tables(f.read()), "run", "error")}
    assert set(rows) == set(jobs)
    asked = {"0": ["zero3"], "1": ["zero1", "zero2"]}
    for job, s in jobs.items():
        assert rows[job]["status"][0] == s["status"]
        assert rows[job]["engine"][0] == "memopt"
        assert sorted(rows[job]["strategy"][0].split("+")) == asked[job]
    assert "rank 1" in rows["0"]["error"][0] or "injected fault" in rows["0"]["error"][0]


def test_report_cli_on_a_missing_dir_fails(tmp_path):
    rep = run_module("memopt.report", [str(tmp_path / "nope")], cwd=str(tmp_path))
    assert rep.returncode == 2 and "not a directory" in rep.stderr
