"""``python -m memopt.report SWEEP_DIR``: one comparison table for every run of a sweep.

Reads each job's ``summary.json`` (and ``.hydra/overrides.yaml`` for what the job changed) and prints
one row per job: status, engine, strategies, final loss, tokens/s, peak bytes per category on the
compute device (the maximum over ranks). ``--json`` writes the rows as JSON instead.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

CATS = ("params", "grads", "optim", "activations", "temp", "chunks", "other", "total")


def _mib(b) -> str:
    return f"{b / 2**20:.1f}" if isinstance(b, (int, float)) else "-"


def collect(sweep_dir: str) -> list[dict]:
    if not os.path.isdir(sweep_dir):
        raise FileNotFoundError(f"{sweep_dir} is not a directory; give a Hydra sweep directory (multirun output)")
    rows = []
    for path in sorted(glob.glob(os.path.join(sweep_dir, "**", "summary.json"), recursive=True)):
        job_dir = os.path.dirname(path)
        with open(path) as f:
            s = json.load(f)
        overrides = []
        ov = os.path.join(job_dir, ".hydra", "overrides.yaml")
        if os.path.exists(ov):
            import yaml

            with open(ov) as f:
                overrides = yaml.safe_load(f) or []
        device_peaks: dict[str, int] = {}
        host_total = 0
        for devs in (s.get("peak_bytes") or {}).values():
            for dev, cats in devs.items():
                if dev == "host":
                    host_total = max(host_total, cats.get("total", 0))
                    continue
                for c in CATS:
                    device_peaks[c] = max(device_peaks.get(c, 0), cats.get(c, 0))
        rows.append({
            "job": os.path.relpath(job_dir, sweep_dir), "overrides": " ".join(overrides), "status": s.get("status"),
            "engine": s.get("engine"), "strategy": "+".join(s.get("strategy") or ["plain"]) if s.get("status") != "refused" else "-",
            "final_loss": s.get("final_loss"), "tokens_per_s": s.get("tokens_per_s"), "mfu": s.get("mfu"),
            "peak_device": device_peaks, "peak_host_total": host_total, "error": s.get("error"),
        })
    return rows


def format_table(rows: list[dict]) -> str:
    head = ["job", "status", "engine", "strategy", "loss", "tok/s"] + [f"{c} MiB" for c in CATS] + ["host MiB"]
    lines = [head]
    for r in rows:
        p = r["peak_device"]
        lines.append([
            r["job"], r["status"], str(r["engine"]), r["strategy"],
            f"{r['final_loss']:.4f}" if isinstance(r["final_loss"], float) else "-",
            f"{r['tokens_per_s']:,.0f}" if isinstance(r["tokens_per_s"], float) else "-",
            *[_mib(p.get(c)) if p else "-" for c in CATS], _mib(r["peak_host_total"]) if r["peak_host_total"] else "-",
        ])
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    for r in rows:
        if r["error"]:
            out.append(f"{r['job']}: {r['status']}: {r['error']}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    try:
        rows = collect(args.sweep_dir)
    except FileNotFoundError as e:
        print(f"memopt.report: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"memopt.report: no summary.json under {args.sweep_dir}", file=sys.stderr)
        return 1
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
