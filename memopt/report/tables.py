"""The report's tables as (header, rows) of cells, shared by the markdown, HTML and text renderers.

A cell is ``(text, value)``: the formatted text people read and the exact number it came from
(``None`` for text), which the HTML keeps in a ``data-value`` attribute for tools and tests.
"""
from __future__ import annotations

from memopt.report.baseline import Ratio
from memopt.report.collect import CATEGORIES, HOST, Run

Cell = tuple[str, object]
Table = tuple[list[str], list[list[Cell]]]
MiB = 2**20


def num(v, fmt: str) -> Cell:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return format(v, fmt), v
    return "-", None


def text(v) -> Cell:
    return ("-" if v is None or v == "" else str(v)), None


def mib(b) -> Cell:
    if not isinstance(b, (int, float)):
        return "-", None
    return f"{b / MiB:,.1f}", b


def runs_table(runs: list[Run]) -> Table:
    head = ["run", "job", "status", "engine", "strategy", "model", "ranks", "final loss", "val loss", "tokens/s",
            "TFLOP/s", "MFU", "device peak MiB", "host peak MiB"]
    rows = []
    for r in runs:
        rows.append([text(r.label), text(r.job), text(r.status), text(r.engine), text(r.strategy_name), text(r.model),
                     text(r.world_size), num(r.get("final_loss"), ".4f"), num(r.get("val_loss"), ".4f"),
                     num(r.get("tokens_per_s"), ",.0f"), num(r.get("tflops"), ".4f"), num(r.get("mfu"), ".2%"),
                     mib(r.peaks("device").get("total")), mib(r.peaks(HOST).get("total"))])
    return head, rows


def categories_table(runs: list[Run], side: str) -> Table | None:
    """Each category's own peak (maximum over ranks); ``total`` is the measured peak of the sum,
    which is below the sum of the category peaks (they peak at different moments)."""
    with_peaks = [r for r in runs if r.peaks(side)]
    if not with_peaks:
        return None
    if side == HOST and not any(r.peaks(HOST).get("total") for r in with_peaks):
        return None
    cats = [c for c in CATEGORIES if any(r.peaks(side).get(c) for r in with_peaks)] + ["total"]
    head = ["run"] + [f"{c} MiB" for c in cats]
    return head, [[text(r.label)] + [mib(r.peaks(side).get(c, 0)) for c in cats] for r in with_peaks]


def ratio_table(ratios: list[Ratio]) -> Table | None:
    if not ratios:
        return None
    head = ["run", "baseline", "tokens/s ratio", "device peak ratio", "host peak ratio", "final loss - baseline"]
    return head, [[text(q.run.label), text(q.base.label), num(q.tokens_per_s, ".2f"), num(q.peak_device, ".2f"),
                   num(q.peak_host, ".2f"), num(q.loss_delta, "+.4f")] for q in ratios]


def failures_table(runs: list[Run]) -> Table | None:
    bad = [r for r in runs if not r.ok]
    if not bad:
        return None
    head = ["run", "job", "status", "engine", "strategy", "error"]
    rows = []
    for r in bad:
        err = str(r.summary.get("error") or "").strip().splitlines()
        rows.append([text(r.label), text(r.job), text(r.status), text(r.engine), text(r.strategy_name),
                     text(err[0][:300] if err else None)])
    return head, rows


# ---- the fixed-width text table that `python -m memopt.report` prints -----------------------
TEXT_CATS = CATEGORIES + ("total",)


def format_text(runs: list[Run]) -> str:
    head = ["job", "status", "engine", "strategy", "loss", "tok/s"] + [f"{c} MiB" for c in TEXT_CATS] + ["host MiB", "run"]
    lines = [head]
    for r in runs:
        p, h = r.peaks("device"), r.peaks(HOST).get("total")
        lines.append([r.job, r.status, str(r.engine), r.strategy_name, num(r.get("final_loss"), ".4f")[0],
                      num(r.get("tokens_per_s"), ",.0f")[0], *[mib(p.get(c))[0] if p else "-" for c in TEXT_CATS],
                      mib(h)[0] if h else "-", r.label])
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    for r in runs:
        if r.summary.get("error"):
            out.append(f"{r.job}: {r.status}: {r.summary['error']}")
    return "\n".join(out)
