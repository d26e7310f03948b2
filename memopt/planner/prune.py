"""Fewer plans for the same winner: a composition's smaller micro-batches are skipped once a larger one fits.

``+strategy=auto`` tries each composition at several micro-batch sizes, the accumulation keeping the global
batch. For one composition a smaller micro-batch runs the same FLOPs over more micro-batches: the same
compute and memory-bound bytes, more ops, as many or more collectives and copies; its predicted step is
never shorter, and its peak never higher. So the search plans a composition's sizes from the largest down
and stops at the first that fits: the ones below it cannot win (a tie keeps the larger, which the ranking
lists first anyway). Two kinds are planned at every size, because there a smaller micro-batch can be faster:
a pipeline (more micro-batches shrink the bubble) and the chunk engine (smaller activations leave the device
room for more optimizer groups, whose Adam then runs on the device).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

SKIPPED = "not planned: a larger micro-batch of this composition fits, and a smaller one is never predicted faster"


def chains(keys: Sequence, micro_batches: Sequence[int], every_size: Sequence[bool]) -> list[list[int]]:
    """Candidate indices in planning chains: candidates with the same ``keys[i]`` (the composition without
    its micro-batch and accumulation) in one chain, largest micro-batch first; ``every_size[i]``: a
    candidate planned on its own (pipeline, chunk engine)."""
    groups: dict = {}
    out: list[list[int]] = []
    for i, key in enumerate(keys):
        if every_size[i]:
            out.append([i])
        else:
            groups.setdefault(key, []).append(i)
    out += [sorted(g, key=lambda i: -micro_batches[i]) for g in groups.values()]
    return sorted(out, key=lambda c: min(c))


def plan_chain(chain: Sequence, plan: Callable[..., dict], *args) -> list[dict]:
    """``plan(item, *args)`` for each candidate of ``chain`` in order until one fits; the rest get a row saying
    why they were skipped (``fits`` False, ``skipped`` True, their ``candidate`` and ``overrides``). Module
    level, picklable data in and out: a worker process plans a whole chain."""
    rows: list[dict] = []
    for item in chain:
        if any(r["fits"] for r in rows):
            rows.append({"overrides": item.overrides(), "candidate": item, "fits": False, "skipped": True, "why": SKIPPED})
        else:
            rows.append(plan(item, *args))
    return rows
