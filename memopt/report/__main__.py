"""``python -m memopt.report DIR... [--baseline KEY=VALUE] [--out DIR] [--wandb] [--json]``: the report's
command line (the package holds what it calls: ``gather``, ``write_report``, ``make_wandb_report``)."""
from __future__ import annotations

import argparse
import json
import sys

from memopt.report import default_out, gather, make_wandb_report, write_report
from memopt.report.collect import Run
from memopt.report.tables import format_text


def _json_rows(runs: list[Run]) -> list[dict]:
    from memopt.report.collect import HOST

    return [{"job": r.job, "label": r.label, "overrides": " ".join(r.overrides), "status": r.status, "engine": r.engine,
             "strategy": r.strategy_name, "model": r.model, "world_size": r.world_size,
             "final_loss": r.get("final_loss"), "val_loss": r.get("val_loss"), "tokens_per_s": r.get("tokens_per_s"),
             "tflops": r.get("tflops"), "mfu": r.get("mfu"), "peak_device": r.peaks("device"),
             "peak_host": r.peaks(HOST), "peak_host_total": r.peaks(HOST).get("total", 0), "error": r.summary.get("error"),
             "path": r.path} for r in runs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memopt.report", description="Tables, figures and a report from sweeps and runs")
    ap.add_argument("dirs", nargs="+", metavar="DIR",
                    help="a sweep directory, run directories, or wandb:ENTITY/PROJECT/GROUP (synced runs)")
    ap.add_argument("--baseline", default=None, metavar="KEY=VALUE", help="the run(s) to divide by, e.g. engine=deepspeed")
    ap.add_argument("--out", default=None, help="where report.md/html and figures/ go")
    ap.add_argument("--wandb", action="store_true", help="also build a W&B Report")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of the text table")
    args = ap.parse_args(argv)
    try:
        runs = gather(args.dirs)
    except (FileNotFoundError, ValueError) as e:
        print(f"memopt.report: {e}", file=sys.stderr)
        return 2
    if not runs:
        print(f"memopt.report: no run (summary.json or .hydra/) under {' '.join(args.dirs)}", file=sys.stderr)
        return 1
    out = args.out or default_out(args.dirs)
    print(json.dumps(_json_rows(runs), indent=2) if args.json else format_text(runs))
    try:
        paths = write_report(runs, out, args.dirs, args.baseline)
    except ValueError as e:  # a --baseline that names no run
        print(f"memopt.report: {e}", file=sys.stderr)
        return 2
    print(f"report: {paths['md']} and {paths['html']}", file=sys.stderr)
    if args.wandb:
        print(make_wandb_report(runs, out), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
