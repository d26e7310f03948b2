"""The step-time refit: the GPU profile's two rates from the check's own numbers, and every plan again with them.

Why: a GPU profile prices the whole step with one ``compute_efficiency`` (plain bf16's FLOPs at peak over its
measured step), so the memory-bound ops ride inside it, and a composition that moves more bytes per FLOP than
plain's is planned too fast (chunked_loss -9.3% on the seventh check's H200). The planner already has the term
that fixes this (``hardware.memory_gbps``: the step's memory-bound bytes at that rate); what it lacked is a
measured rate. The env section measures the device's elementwise rate, and the plain step untracked gives the
efficiency of the products once those bytes are taken out of it:

    memory_gbps = the env section's measured rate
    compute_efficiency = plain's FLOPs-at-peak seconds / (plain's untracked step - plain's op bytes / memory_gbps)

Every other composition is then planned again with the two (its compute term scaled, its memory term added, its
offload, communication and optimizer terms as planned) and compared with its untracked step, so the session
that runs the check reads off both the profile's new lines and what they do to each plan.
"""
from __future__ import annotations

PLAIN = "plain_bf16"  # the composition the efficiency is fitted on (settings.COMPOSITIONS' first)
OTHER_TERMS = ("offload_s", "comm_s", "optimizer_s")  # as planned, in the fit and the refit alike
# terms of plan.step_time this arithmetic does not redo (none in today's GPU profiles): a plan with one is not refitted
NOT_REDONE = ("memory_s", "overhead_s", "attention_efficiency", "bubble_fraction")


def rel_err(planned, measured):
    """(planned - measured) / measured; None without both."""
    return None if planned is None or not measured else (planned - measured) / measured


def timed_runs(runs: list[dict]) -> dict[str, dict]:
    """The runs that finished with a step time, by name."""
    return {r.get("name"): r for r in runs if r.get("status") == "ok" and r.get("step_time_s")}


def _rest(terms: dict) -> float:
    return sum(terms.get(k) or 0.0 for k in OTHER_TERMS)


def step_time_fit(gbps: float | None, tracked: list[dict], untracked: list[dict]) -> dict:
    """``gbps``: the device's measured rate (GB/s of bytes read + written); ``tracked``: the compositions
    section's runs (their plans: ``planned_step_terms``, ``planned_op_bytes``); ``untracked``: the throughput
    section's reruns (``step_time_s`` without the tracker). Returns the fitted profile lines and each
    composition's plan with them (what ``plan.step_time`` gives with the two lines in the profile), or
    ``{"error": why}`` when the numbers do not allow a fit."""
    if not gbps:
        return {"error": "no measured device memory rate (the env section's memory_bandwidth)"}
    plans = {r.get("name"): r for r in tracked}
    steps = {name: r["step_time_s"] for name, r in timed_runs(untracked).items()}
    base = plans.get(PLAIN) or {}
    terms = base.get("planned_step_terms") or {}
    if steps.get(PLAIN) is None or terms.get("compute_s") is None or base.get("planned_op_bytes") is None:
        return {"error": f"{PLAIN} has no untracked step or no planned compute term and memory-bound bytes to fit on"}
    extra = sorted({k for r in plans.values() for k in NOT_REDONE if (r.get("planned_step_terms") or {}).get(k)})
    if extra:
        return {"error": f"the plans have terms this refit does not redo ({', '.join(extra)}): plan again with "
                         f"hardware.memory_gbps={gbps:.0f} and a refitted compute_efficiency instead"}
    at_peak = terms["compute_s"] * terms["compute_efficiency"]  # the FLOPs' seconds at the datasheet peak
    products = steps[PLAIN] - base["planned_op_bytes"] / (gbps * 1e9) - _rest(terms)
    if products <= at_peak:
        return {"error": f"{PLAIN}'s memory-bound bytes at {gbps:,.0f} GB/s leave {products:.4f} s of its "
                         f"{steps[PLAIN]:.4f} s step for products that take {at_peak:.4f} s at peak: an efficiency over 1"}
    eff = at_peak / products
    rows = []
    for name, r in plans.items():
        t = r.get("planned_step_terms") or {}
        if name not in steps or t.get("compute_s") is None or r.get("planned_op_bytes") is None:
            continue
        refit = t["compute_s"] * t["compute_efficiency"] / eff + r["planned_op_bytes"] / (gbps * 1e9) + _rest(t)
        rows.append({"name": name, "measured_s": steps[name], "planned_s": r.get("planned_step_s"),
                     "rel_err": rel_err(r.get("planned_step_s"), steps[name]), "refit_s": refit,
                     "refit_rel_err": rel_err(refit, steps[name]), "op_bytes": r["planned_op_bytes"]})
    return {"memory_gbps": gbps, "compute_efficiency": eff, "profile_compute_efficiency": terms["compute_efficiency"],
            "rows": rows}


def offload_exposed(tracked: list[dict], untracked: list[dict], name: str = "zero2_offload") -> dict:
    """How much of ZeRO-Offload's planned offload term its untracked step showed: its step less its optimizer step,
    less plain's step less plain's optimizer step (what the backward's copies to the host added to the forward and
    backward), against the plan's offload term. Why: the plan sums the terms, and the side stream hid the copies on
    the H200 (the plan 14% over) but not on the H100 hosts (7-18 ms showed): this reads it on every check."""
    steps = timed_runs(untracked)
    plan = next((r for r in tracked if r.get("name") == name), {})
    planned = (plan.get("planned_step_terms") or {}).get("offload_s")
    zo, plain = steps.get(name), steps.get(PLAIN)
    if not (zo and plain and zo.get("optim_step_s") is not None and plain.get("optim_step_s") is not None and planned):
        return {}
    shown = (zo["step_time_s"] - zo["optim_step_s"]) - (plain["step_time_s"] - plain["optim_step_s"])
    return {"planned_offload_s": planned, "shown_s": shown, "shown_fraction": shown / planned}
