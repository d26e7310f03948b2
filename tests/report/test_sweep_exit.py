"""A sweep whose every job fails exits non-zero, and its report still names each job's engine,
strategies and status."""
from __future__ import annotations

import os

from tests.report.helpers import QUICK, Tables, run_module, summaries, table_by_header


def test_sweep_where_every_job_fails_exits_nonzero(tmp_path):
    sweep = str(tmp_path / "allbad")
    proc = run_module("memopt.train", ["-m", f"hydra.sweep.dir={sweep}", "logger=none", *QUICK,
                                       "+strategy=[fp16,bf16],[zero1,zero2]", "engine=deepspeed"], cwd=str(tmp_path))
    assert proc.returncode != 0
    assert "every job of the sweep failed" in proc.stderr
    jobs = summaries(sweep)
    assert sorted(s["status"] for s in jobs.values()) == ["refused", "refused"]
    with open(os.path.join(sweep, "report.html")) as f:
        rows = {r["job"][0]: r for r in table_by_header(Tables(f.read()), "run", "error")}
    assert set(rows) == set(jobs)
    for job, s in jobs.items():
        assert rows[job]["status"][0] == "refused"
        assert rows[job]["engine"][0] == "deepspeed" == s["engine"]
        assert rows[job]["strategy"][0] == "+".join(s["strategy"]) and len(s["strategy"]) == 2


def test_report_cli_on_a_missing_dir_fails(tmp_path):
    rep = run_module("memopt.report", [str(tmp_path / "nope")], cwd=str(tmp_path))
    assert rep.returncode == 2 and "not a directory" in rep.stderr
