"""``python -m memopt.report DIR...``: compare the runs of a sweep (or several run directories).

A W&B group (``wandb:ENTITY/PROJECT/GROUP``) works too. Prints one text row per run on stdout
(``--json``: the rows as JSON) and writes, into ``--out`` (default: the directory given, the common
parent of several, or ``report-<group>``), ``report.md``, a self-contained
``report.html`` and ``figures/*.png``: peak bytes per category (device and host), tokens/s and MFU,
loss curves, memory per step, ratios against ``--baseline key=value``. ``--wandb`` adds a W&B Report
(published with credentials; otherwise ``wandb_report.json`` and the command that publishes it).
"""
from __future__ import annotations

import os

from memopt.report.collect import Run, collect_runs


def write_report(runs: list[Run], out_dir: str, sources: list[str], baseline: str | None = None) -> dict[str, str]:
    """report.md, report.html and the figures for ``runs`` into ``out_dir``; returns their paths."""
    from memopt.report import document, figures, html, markdown
    from memopt.report.baseline import pick_baselines, ratios

    os.makedirs(out_dir, exist_ok=True)
    rat = ratios(runs, pick_baselines(runs, baseline))
    figs = figures.draw_all(runs, rat, out_dir)
    doc = document.build(runs, rat, figs, sources, baseline)
    return {"md": markdown.write(doc, out_dir), "html": html.write(doc, out_dir), **{os.path.basename(p): p for _, p in figs}}


def make_wandb_report(runs: list[Run], out_dir: str) -> str:
    """Publish the W&B Report when credentials exist; else write its spec and say how to publish it."""
    from memopt.logging import wandb_mode
    from memopt.report import wandb_report as wr

    spec = wr.build_spec(runs)
    path = wr.write_spec(spec, out_dir)
    later = f"publish it later with:\n  {wr.publish_command(path, runs)}"
    if wandb_mode("auto") == "online":
        try:
            return f"W&B report: {wr.publish(spec)}"
        except Exception as e:  # no package, no network: the spec is on disk
            return f"W&B report not published ({type(e).__name__}: {e}); spec in {path}; {later}"
    return f"W&B report spec written to {path} (no W&B credentials); {later}"


def gather(sources: list[str], api=None) -> list[Run]:
    """Runs from run/sweep directories and ``wandb:ENTITY/PROJECT/GROUP`` sources, labelled together."""
    from memopt.report.collect import label_runs
    from memopt.report.wandb_source import collect_group, is_wandb_source

    dirs = [s for s in sources if not is_wandb_source(s)]
    runs = collect_runs(dirs) if dirs else []
    for s in sources:
        if is_wandb_source(s):
            runs += collect_group(s, api)
    if len(dirs) < len(sources) and len(sources) > 1:
        label_runs(runs)
    return runs


def default_out(sources: list[str]) -> str:
    """The directory given, the common parent of several, or ``report-<group>`` for a W&B group."""
    from memopt.report.wandb_source import is_wandb_source, parse

    dirs = [os.path.abspath(s) for s in sources if not is_wandb_source(s)]
    if not dirs:
        return f"report-{parse(sources[0])[1]}"
    return sources[0] if len(sources) == 1 else os.path.commonpath(dirs)
