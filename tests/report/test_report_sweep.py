"""A small sweep through the CLI (plain, chunk engine, one refused job), then `python -m memopt.report`:
the report lists every job with the numbers of its summary.json, the figures are real PNGs, the W&B
report specification names every run and panel, and the W&B runs carry the tables, tags and metrics."""
from __future__ import annotations

import base64
import json
import os

import pytest

from tests.report.helpers import PNG_MAGIC, QUICK, Tables, device_peak_total, run_module, summaries, table_by_header

STRATEGIES = ["[]", "chunk", "[fp16,bf16]"]  # plain, chunk engine (per-step chunk metrics), refused


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    sweep = str(tmp / "sw")
    proc = run_module("memopt.train", ["-m", f"hydra.sweep.dir={sweep}", *QUICK, f"+strategy={','.join(STRATEGIES)}"], cwd=str(tmp))
    assert proc.returncode == 0, proc.stderr[-3000:]  # one job refused: the sweep still succeeds
    rep = run_module("memopt.report", [sweep, "--wandb", "--baseline", "strategy=[]"], cwd=str(tmp))
    assert rep.returncode == 0, rep.stderr[-3000:]
    return sweep, proc, rep


def _jobs(sweep: str) -> dict[str, dict]:
    s = summaries(sweep)
    assert len(s) == len(STRATEGIES)
    return s


def _overrides(sweep: str, job: str) -> list[str]:
    import yaml

    with open(os.path.join(sweep, job, ".hydra", "overrides.yaml")) as f:
        return yaml.safe_load(f)


def test_sweep_callback_wrote_the_report(sweep):
    path, proc, _ = sweep
    assert "sweep report in" in proc.stderr
    assert os.path.getsize(os.path.join(path, "report.md")) > 0 and os.path.getsize(os.path.join(path, "report.html")) > 0


def test_html_lists_every_job_with_its_summary_numbers(sweep):
    path, _, _ = sweep
    with open(os.path.join(path, "report.html")) as f:
        page = Tables(f.read())
    rows = {r["job"][0]: r for r in table_by_header(page, "run", "tokens/s")}
    jobs = _jobs(path)
    assert set(rows) == set(jobs)
    for job, s in jobs.items():
        row = rows[job]
        assert row["status"][0] == s["status"]
        assert f"+strategy={STRATEGIES[int(job)]}" in _overrides(path, job)
        assert row["run"][0] == f"strategy={STRATEGIES[int(job)]}"  # the only override that differs
        if s["status"] != "ok":
            continue
        assert row["engine"][0] == s["engine"] and row["strategy"][0] == ("+".join(s["strategy"]) or "plain")
        assert float(row["final loss"][1]) == s["final_loss"] and row["final loss"][0] == f"{s['final_loss']:.4f}"
        assert float(row["tokens/s"][1]) == s["tokens_per_s"]
        assert float(row["MFU"][1]) == s["mfu"]
        assert int(row["device peak MiB"][1]) == device_peak_total(s)


def test_refused_job_is_named_by_its_engine_and_strategies(sweep):
    path, _, _ = sweep
    job, s = next((j, s) for j, s in _jobs(path).items() if s["status"] == "refused")
    assert s["engine"] == "memopt" and sorted(s["strategy"]) == ["bf16", "fp16"]  # train.py records what was refused
    with open(os.path.join(path, "report.html")) as f:
        page = Tables(f.read())
    failed = {r["job"][0]: r for r in table_by_header(page, "run", "error")}
    assert set(failed) == {job}
    assert failed[job]["engine"][0] == "memopt" and failed[job]["strategy"][0] == "+".join(s["strategy"])
    assert failed[job]["status"][0] == "refused" and "mutually exclusive" in failed[job]["error"][0]


def test_markdown_lists_every_job_with_its_numbers(sweep):
    path, _, _ = sweep
    with open(os.path.join(path, "report.md")) as f:
        md = f.read()
    lines = {line.split("|")[2].strip(): line for line in md.splitlines()
             if line.startswith("| strategy=") and line.count("|") > 10}  # the runs table: | run | job | ...
    jobs = _jobs(path)
    assert set(lines) == set(jobs)
    for job, s in jobs.items():
        assert f"| {s['status']} |" in lines[job]
        if s["status"] == "ok":
            assert f"| {s['final_loss']:.4f} |" in lines[job] and f"| {s['tokens_per_s']:,.0f} |" in lines[job]
            assert f"| {device_peak_total(s) / 2**20:,.1f} |" in lines[job]


def test_figures_are_png_files_and_embedded(sweep):
    path, _, _ = sweep
    names = {"peak_bytes.png", "throughput.png", "loss.png", "memory_per_step.png", "ratios.png"}
    for name in names:
        with open(os.path.join(path, "figures", name), "rb") as f:
            data = f.read()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, name
    with open(os.path.join(path, "report.html")) as f:
        page = Tables(f.read())
    embedded = {img["data-file"]: img["src"] for img in page.images}
    assert set(embedded) == names  # self-contained: no figure is a link
    for src in embedded.values():
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == PNG_MAGIC
    with open(os.path.join(path, "report.md")) as f:
        md = f.read()
    assert all(f"(figures/{n})" in md for n in names)


def test_ratios_are_against_the_plain_run(sweep):
    path, _, _ = sweep
    jobs = _jobs(path)
    base = next(s for j, s in jobs.items() if STRATEGIES[int(j)] == "[]")
    with open(os.path.join(path, "report.html")) as f:
        rows = table_by_header(Tables(f.read()), "run", "tokens/s ratio")
    chunk = next(r for r in rows if r["run"][0] == "strategy=chunk")
    s = next(s for s in jobs.values() if s["strategy"] == ["chunk"])
    assert chunk["baseline"][0] == "strategy=[]"
    assert float(chunk["tokens/s ratio"][1]) == pytest.approx(s["tokens_per_s"] / base["tokens_per_s"])
    assert float(chunk["device peak ratio"][1]) == pytest.approx(device_peak_total(s) / device_peak_total(base))


def test_wandb_report_spec_names_every_run_and_panel(sweep):
    path, _, rep = sweep
    spec_path = os.path.join(path, "wandb_report.json")
    assert "wandb_report.json" in rep.stderr and "python -m memopt.report.wandb_report" in rep.stderr  # publish later
    with open(spec_path) as f:
        spec = json.load(f)
    jobs = _jobs(path)
    runs = {r["job"]: r for r in spec["runs"]}
    assert set(runs) == set(jobs)
    for job, s in jobs.items():
        assert runs[job]["status"] == s["status"]
        offline = [d for d in os.listdir(os.path.join(path, job, "wandb"))] if s["status"] == "ok" else []
        if s["status"] == "ok":
            assert any(d.endswith(runs[job]["wandb_id"]) for d in offline)
            assert runs[job]["tokens_per_s"] == s["tokens_per_s"] and runs[job]["group"] == "sw"
    assert spec["groups"] == ["sw"] and "sw" in spec["runset"]["filters"]
    panels = [p for b in spec["blocks"] if b["type"] == "PanelGrid" for p in b["panels"]]
    lines = {tuple(p["y"]) for p in panels if p["type"] == "LinePlot"}
    bars = [m for p in panels if p["type"] == "BarPlot" for m in p["metrics"]]
    assert ("loss",) in lines and ("val_loss",) in lines
    assert "tokens_per_s" in bars and "mfu" in bars
    for cat in ("params", "grads", "optim", "activations", "total"):
        assert f"peak_bytes/0/cpu/{cat}" in bars
    assert any(p["type"] == "WeavePanelSummaryTable" and p["table_name"] == "peak_bytes_table" for p in panels)
    table = next(b["text"] for b in spec["blocks"] if b["type"] == "MarkdownBlock")
    assert all(f"| {job} |" in table for job in jobs)  # the runs table


def test_wandb_report_publishes_through_wandb_workspaces(sweep, monkeypatch):
    """The spec maps onto wandb-workspaces' Report; only the network call (save) is replaced."""
    wr = pytest.importorskip("wandb_workspaces.reports.v2")
    from memopt.report import wandb_report

    path, _, _ = sweep
    with open(os.path.join(path, "wandb_report.json")) as f:
        spec = json.load(f)
    saved = []

    def fake_save(self, draft=False, clone=False):
        saved.append(self)
        self.id = "abc123"
        return self

    monkeypatch.setattr(wr.Report, "save", fake_save)
    monkeypatch.setattr(wr.Report, "url", property(lambda self: f"report/{self.id}"))
    assert wandb_report.publish(spec, entity="someone") == "report/abc123"
    (report,) = saved
    grid = next(b for b in report.blocks if isinstance(b, wr.PanelGrid))
    assert [type(p).__name__ for p in grid.panels].count("LinePlot") == 3
    assert {getattr(p, "title", None) for p in grid.panels} >= {"training loss", "tokens/s (median after warm-up)"}
    assert any(isinstance(p, wr.WeavePanelSummaryTable) and p.table_name == "peak_bytes_table" for p in grid.panels)
    assert grid.runsets[0].filters == "Group = 'sw'" and report.entity == "someone"


def test_wandb_runs_log_peak_table_tags_and_chunk_metrics(sweep):
    from memopt.logging import read_wandb_offline

    path, _, _ = sweep
    job, s = next((j, s) for j, s in _jobs(path).items() if s["strategy"] == ["chunk"])
    w = read_wandb_offline(os.path.join(path, job))
    assert {"gpt_tiny", "memopt", "chunk", "world_size=1"} <= set(w["tags"])
    with open(os.path.join(path, job, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    logged = [h for h in w["history"] if "loss" in h]
    assert [h["chunk/evictions"] for h in logged] == [r["chunk"]["evictions"] for r in recs]
    assert [h["chunk/chunks_on_device"] for h in logged] == [r["chunk"]["chunks_on_device"] for r in recs]
    assert w["summary"]["peak_bytes_table/_type"] == "table-file"
    assert w["summary"]["peak_bytes_chart_table/_type"] == "table-file"  # the wandb.plot.bar chart's data
    run_dir = next(d for d in os.listdir(os.path.join(path, job, "wandb")) if d.startswith("offline-run-"))
    with open(os.path.join(path, job, "wandb", run_dir, "files", w["summary"]["peak_bytes_table/path"])) as f:
        table = json.load(f)
    got = {(r[0], r[1], r[2]): r[3] for r in table["data"]}
    want = {(rank, dev, cat): b for rank, devs in s["peak_bytes"].items() for dev, cats in devs.items() for cat, b in cats.items()}
    assert table["columns"][:4] == ["rank", "device", "category", "bytes"] and got == want


class _FakeApi:
    """wandb.Api() over the sweep's offline runs (read back from their .wandb files): the network replaced."""

    def __init__(self, sweep: str):
        from types import SimpleNamespace

        from memopt.logging import read_wandb_offline

        self.runs_ = []
        for job, s in summaries(sweep).items():
            if os.path.isdir(os.path.join(sweep, job, "wandb")):
                w = read_wandb_offline(os.path.join(sweep, job))
                rid = next(d for d in os.listdir(os.path.join(sweep, job, "wandb")) if d.startswith("offline-run-"))
                self.runs_.append(SimpleNamespace(id=rid.rsplit("-", 1)[-1], name=f"job{job}", group=w["group"], state="finished",
                                                  summary=w["summary"], config=w["config"],
                                                  scan_history=lambda h=w["history"]: iter(h)))
        self.asked = []

    def runs(self, path, filters):
        self.asked.append((path, filters))
        return [r for r in self.runs_ if r.group == filters["group"]]


def test_report_from_a_wandb_group(sweep, tmp_path):
    from memopt.report import gather, write_report

    path, _, _ = sweep
    api = _FakeApi(path)
    runs = gather(["wandb:someone/memopt/sw"], api=api)
    assert api.asked == [("someone/memopt", {"group": "sw"})]
    ok = {j: s for j, s in _jobs(path).items() if s["status"] == "ok"}
    assert sorted(r.job for r in runs) == sorted(f"job{j}" for j in ok)
    paths = write_report(runs, str(tmp_path), ["wandb:someone/memopt/sw"])
    with open(paths["html"]) as f:
        rows = {r["job"][0]: r for r in table_by_header(Tables(f.read()), "run", "tokens/s")}
    for job, s in ok.items():
        row = rows[f"job{job}"]
        assert float(row["final loss"][1]) == s["final_loss"] and float(row["tokens/s"][1]) == s["tokens_per_s"]
        assert int(row["device peak MiB"][1]) == device_peak_total(s)
        assert row["strategy"][0] == ("+".join(s["strategy"]) or "plain") and row["engine"][0] == s["engine"]
    with open(os.path.join(str(tmp_path), "figures", "loss.png"), "rb") as f:
        assert f.read(8) == PNG_MAGIC
