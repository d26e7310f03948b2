"""Ratios against a baseline run, chosen with ``--baseline key=value`` (e.g. ``engine=deepspeed``).

When several runs match (a matrix: engine x strategy), each run is compared with the matching run
that shares its other varying overrides, so ``zero2/memopt`` is divided by ``zero2/deepspeed`` and
``zero3/memopt`` by ``zero3/deepspeed``. One match is the baseline of every run.
"""
from __future__ import annotations

from dataclasses import dataclass

from memopt.report.collect import HOST, Run, parse_overrides, varying_keys


@dataclass
class Ratio:
    run: Run
    base: Run
    tokens_per_s: float | None
    peak_device: float | None
    peak_host: float | None
    loss_delta: float | None


def matches(run: Run, key: str, value: str) -> bool:
    """``key=value`` names the run by one of its overrides or by a field of its summary."""
    if parse_overrides(run.overrides).get(key) == value:
        return True
    attrs = {"engine": run.engine, "model": run.model, "status": run.status,
             "world_size": str(run.world_size), "strategy": run.strategy_name}
    if key == "strategy":
        return value.strip("[]").replace(",", "+") == run.strategy_name
    return attrs.get(key) == value or str(run.summary.get(key)) == value


def pick_baselines(runs: list[Run], spec: str | None) -> dict[str, Run]:
    """job -> its baseline run. Default (no ``spec``): the first run that finished."""
    ok = [r for r in runs if r.ok]
    if not spec:
        return {r.job: ok[0] for r in runs} if ok else {}
    key, sep, value = spec.partition("=")
    if not sep:
        raise ValueError(f"--baseline wants key=value (e.g. engine=deepspeed), got {spec!r}")
    key = key.lstrip("+~")
    cands = [r for r in ok if matches(r, key, value)]
    if not cands:
        raise ValueError(f"--baseline {spec}: no finished run matches (runs: {', '.join(r.label for r in runs)})")
    var = varying_keys(runs)

    def rest(r: Run) -> dict:
        return {k: v for k, v in var[r.job].items() if k != key}

    out = {}
    for r in runs:
        same = [c for c in cands if rest(c) == rest(r)]
        if same:
            out[r.job] = same[0]
        elif len(cands) == 1:
            out[r.job] = cands[0]
    return out


def _div(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def ratios(runs: list[Run], baselines: dict[str, Run]) -> list[Ratio]:
    out = []
    for r in runs:
        b = baselines.get(r.job)
        if b is None or not r.ok:
            continue
        loss = r.get("final_loss"), b.get("final_loss")
        out.append(Ratio(run=r, base=b, tokens_per_s=_div(r.get("tokens_per_s"), b.get("tokens_per_s")),
                         peak_device=_div(r.peaks("device").get("total"), b.peaks("device").get("total")),
                         peak_host=_div(r.peaks(HOST).get("total"), b.peaks(HOST).get("total")),
                         loss_delta=loss[0] - loss[1] if None not in loss else None))
    return out if any(q.run is not q.base for q in out) else []  # one run against itself says nothing
