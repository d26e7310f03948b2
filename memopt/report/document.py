"""What a report says, in order, independent of its format: headings, paragraphs, tables, figures.

markdown.py and html.py render the same list, so report.md and report.html never disagree.
"""
from __future__ import annotations

from memopt.report import tables
from memopt.report.baseline import Ratio
from memopt.report.collect import HOST, Run


def build(runs: list[Run], ratios: list[Ratio], figures: list[tuple[str, str]], sources: list[str],
          baseline: str | None) -> list[tuple]:
    """[("h1"|"h2"|"p", text) | ("table", Table) | ("figure", caption, path)]"""
    ok = sum(r.ok for r in runs)
    doc: list[tuple] = [
        ("h1", "memopt comparison report"),
        ("p", f"{len(runs)} runs ({ok} finished, {len(runs) - ok} failed or refused) from {', '.join(sources)}. "
              "Each run is labelled by the overrides that differ between the runs. Peak bytes are the maximum over "
              "ranks of each category's own peak; a total is the measured peak of the sum."),
        ("h2", "Runs"),
        ("table", tables.runs_table(runs)),
    ]
    for side, title in (("device", "Peak bytes by category on the compute device"), (HOST, "Peak bytes by category on the host")):
        t = tables.categories_table(runs, side)
        if t:
            doc += [("h2", title), ("table", t)]
    t = tables.ratio_table(ratios)
    if t:
        how = f"`--baseline {baseline}`" if baseline else "the first finished run (choose one with `--baseline key=value`)"
        doc += [("h2", "Against the baseline"), ("p", f"Baseline: {how}."), ("table", t)]
    t = tables.failures_table(runs)
    if t:
        doc += [("h2", "Failed and refused jobs"), ("table", t)]
    if figures:
        doc.append(("h2", "Figures"))
        doc += [("figure", caption, path) for caption, path in figures]
    return doc
