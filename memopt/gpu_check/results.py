"""The check's record: gpu_check.json (the structure ``new_results`` documents) and the short table
gpu_check.txt, rewritten after every section so that a section that fails or hangs loses nothing else."""
from __future__ import annotations

import datetime
import json
import os

from memopt.gpu_check.settings import SCHEMA
from memopt.logging import atomic_write_bytes
from memopt.planner.plan import fmt as _fmt_bytes  # the plan table's byte format ("-" for a missing value)


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_text_atomic(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def write_results(out: str, results: dict) -> None:
    """Write gpu_check.json and gpu_check.txt from ``results`` (see ``new_results``)."""
    os.makedirs(out, exist_ok=True)
    write_text_atomic(os.path.join(out, "gpu_check.json"), json.dumps(results, indent=1, default=str) + "\n")
    write_text_atomic(os.path.join(out, "gpu_check.txt"), format_text(results))


def new_results(budget_s: float, mode: str) -> dict:
    """The documented structure: ``sections`` maps each section's name to ``{status, seconds, cap_s,
    result | reason | error}``; status is ok, partial (some cases failed or were cut by the cap),
    error, timeout or skipped."""
    return {"schema": SCHEMA, "tool": "memopt.gpu_check", "mode": mode, "started": utc_now(), "finished": None,
            "budget_s": budget_s, "elapsed_s": 0.0, "status": "running", "sections": {}}


def _fmt(x, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, (int, float)):
        return format(x, spec)
    return str(x)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def format_text(results: dict) -> str:
    lines = [f"memopt gpu check ({results.get('mode')}) started {results.get('started')}, "
             f"status {results.get('status')}, {results.get('elapsed_s', 0):.0f} s of a {results.get('budget_s', 0):.0f} s budget"]
    secs = results.get("sections", {})
    lines.append(f"{'section':<14}{'status':<9}{'seconds':>8}  note")
    for name, s in secs.items():
        note = s.get("reason") or s.get("error") or s.get("note") or ""
        lines.append(f"{name:<14}{s.get('status', '?'):<9}{s.get('seconds', 0):>8.1f}  {str(note).splitlines()[0][:110] if note else ''}")
    env = (secs.get("env") or {}).get("result") or {}
    if env:
        lines.append("")
        lines.append(f"device: {env.get('gpu')}  torch {env.get('torch')}  triton {env.get('triton')}  "
                     f"python {env.get('python')}  import memopt.train: {env.get('import_memopt_train')}")
        bw = env.get("memory_bandwidth") or {}
        if bw.get("gbps"):
            lines.append(f"device memory: {bw['gbps']:,.0f} GB/s ({bw.get('op')}, bytes read + written)")
    tests = (secs.get("tests") or {}).get("result") or {}
    for key, t in tests.items():
        if isinstance(t, dict) and "counts" in t:
            lines.append(f"tests {key}: " + ", ".join(f"{k} {v}" for k, v in t["counts"].items()) +
                         (f"  ({t.get('last_line')})" if t.get("last_line") else "") + (" TIMED OUT" if t.get("timed_out") else ""))
            if "bf16_cuda" in t:
                lines.append("  test_bf16_cuda: " + (", ".join(f"{k.split('::')[-1]} {v}" for k, v in t["bf16_cuda"].items()) or "not reached"))
            for f in t.get("failures", [])[:10]:
                lines.append(f"  {f[:160]}")
    flash = ((secs.get("flash") or {}).get("result") or {}).get("cases") or []
    if flash:
        lines.append("")
        lines.append("FlashAttention fwd+bwd, causal (memopt Triton vs SDPA flash; errors vs fp32 math):")
        lines.append(f"{'dtype':<9}{'D':>4}{'N':>7}{'BxH':>6}  {'impl':<7}{'fwd ms':>8}{'f+b ms':>8}{'f+b TF/s':>9}{'f+b iso':>9}{'f+b host':>9}"
                     f"{'peak':>11}{'err out':>9}{'err dq':>9}{'err dk':>9}{'err dv':>9}")
        for c in flash:
            head = f"{c.get('dtype', '?'):<9}{c.get('head_dim', 0):>4}{c.get('n', 0):>7}{c.get('batch_heads', 0):>6}  "
            if c.get("error"):
                lines.append(head + f"error: {str(c['error']).splitlines()[0][:100]}")
                continue
            for impl in ("memopt", "sdpa"):
                r = c.get(impl) or {}
                if r.get("error"):
                    lines.append(head + f"{impl:<7}error: {str(r['error']).splitlines()[0][:90]}")
                    continue
                e = r.get("max_abs_err") or {}
                lines.append(head + f"{impl:<7}{_fmt(r.get('fwd_ms'), '.3f'):>8}{_fmt(r.get('fwdbwd_ms'), '.3f'):>8}"
                             f"{_fmt(r.get('fwdbwd_tflops'), '.1f'):>9}{_fmt(r.get('fwdbwd_isolated_ms'), '.3f'):>9}{_fmt(r.get('fwdbwd_host_ms'), '.3f'):>9}{_fmt_bytes(r.get('peak_bytes')):>11}"
                             f"{_fmt(e.get('out'), '.1e'):>9}{_fmt(e.get('dq'), '.1e'):>9}{_fmt(e.get('dk'), '.1e'):>9}{_fmt(e.get('dv'), '.1e'):>9}")
                head = " " * len(head)
        split = [c for c in flash if c.get("memopt_host_split")]
        if split:
            lines.append("memopt's host time per f+b, ms: through autograd / the launchers alone / their Python without "
                         "Triton's launches (SDPA's f+b host beside):")
            for c in split:
                h = c["memopt_host_split"]
                lines.append(f"  {c.get('dtype', '?'):<9}{c.get('head_dim', 0):>4}{c.get('n', 0):>7}  "
                             f"{_fmt(h.get('autograd_host_ms'), '.3f')} / {_fmt(h.get('launchers_host_ms'), '.3f')} / "
                             f"{_fmt(h.get('python_host_ms'), '.3f')}  "
                             f"(SDPA {_fmt((c.get('sdpa') or {}).get('fwdbwd_host_ms'), '.3f')})")
    comps = ((secs.get("compositions") or {}).get("result") or {}).get("runs") or []
    if comps:
        lines.append("")
        lines.append("planner vs measured (one GPU; rel err = (planned - measured) / measured):")
        lines.append("(plan dev: the planned tensors, against the tracker; plan need: + cuBLAS's workspaces, against the allocator)")
        lines.append(f"{'composition':<19}{'status':<8}{'plan dev':>11}{'tracker':>11}{'err':>8}{'plan need':>11}{'allocator':>11}{'err':>8}"
                     f"{'plan step':>10}{'step':>9}{'err':>9}{'spread':>8}{'tok/s':>10}{'MFU':>7}")
        for r in comps:
            lines.append(f"{r.get('name', '?'):<19}{str(r.get('status'))[:7]:<8}{_fmt_bytes(r.get('planned_device_bytes')):>11}"
                         f"{_fmt_bytes(r.get('tracker_device_bytes')):>11}{_pct(r.get('rel_err_tracker')):>8}"
                         f"{_fmt_bytes(r.get('planned_device_need_bytes')):>11}"
                         f"{_fmt_bytes(r.get('allocator_peak_bytes')):>11}{_pct(r.get('rel_err_allocator')):>8}"
                         f"{_fmt(r.get('planned_step_s'), '.4f'):>10}{_fmt(r.get('step_time_s'), '.4f'):>9}"
                         f"{_pct(r.get('rel_err_step_time')):>9}{_pct(r.get('step_time_spread')).lstrip('+'):>8}"
                         f"{_fmt(r.get('tokens_per_s'), ',.0f'):>10}"
                         f"{_pct(r.get('mfu')).lstrip('+') if r.get('mfu') is not None else '-':>7}")
            if r.get("error"):
                lines.append(f"  {r['name']}: {str(r['error']).splitlines()[0][:150]}")
        zo = ((secs.get("compositions") or {}).get("result") or {}).get("zero_offload")
        if zo:
            lines.append(f"ZeRO-Offload (zero2 + cpu_offload, {zo.get('engine')}): step {_fmt(zo.get('step_time_s'), '.4f')} s, "
                         f"optimizer step {_fmt(zo.get('optim_step_s'), '.4f')} s; {zo.get('note')}")
            ds = zo.get("deepspeed")
            if ds:
                lines.append(f"  DeepSpeed's (engine=deepspeed): {ds.get('status')}, step {_fmt(ds.get('step_time_s'), '.4f')} s, "
                             f"optimizer step {_fmt(ds.get('optim_step_s'), '.4f')} s; memopt's step "
                             f"{_fmt(zo.get('memopt_speedup_over_deepspeed'), '.2f')}x as fast")
    thr = ((secs.get("throughput") or {}).get("result") or {}).get("runs") or []
    if thr:
        lines.append("")
        lines.append("without the memory tracker (err: the plan against this step; tracker: the tracked step's extra time):")
        for r in thr:
            lines.append(f"  {r.get('name', '?'):<19}{str(r.get('status')):<8}tokens/s {_fmt(r.get('tokens_per_s'), ',.0f')}  "
                         f"TFLOP/s {_fmt(r.get('tflops'), '.1f')}  MFU {_fmt(None if r.get('mfu') is None else 100 * r['mfu'], '.1f')}%  "
                         f"step {_fmt(r.get('step_time_s'), '.4f')} s  plan {_fmt(r.get('planned_step_s'), '.4f')} s  "
                         f"err {_pct(r.get('rel_err_step_time'))}  tracker {_pct(r.get('tracker_cost'))}"
                         + (f"  error: {str(r['error'])[:100]}" if r.get("error") else ""))
    lines.extend(_profile_lines(thr))
    pair = ((secs.get("throughput") or {}).get("result") or {}).get("zero_offload_untracked")
    if pair:
        lines.append(f"  ZeRO-Offload untracked: memopt step {_fmt(pair.get('memopt_step_s'), '.4f')} s, DeepSpeed's "
                     f"{_fmt(pair.get('deepspeed_step_s'), '.4f')} s; memopt's step "
                     f"{_fmt(pair.get('memopt_speedup_over_deepspeed'), '.2f')}x as fast")
    lines.extend(_fit_lines((secs.get("throughput") or {}).get("result") or {}))
    return "\n".join(lines) + "\n"


def _fit_lines(thr: dict) -> list[str]:
    """The step-time refit (gpu_check/fit.py) and ZeRO-Offload's shown copies, under the untracked runs."""
    lines, fit, exp = [], thr.get("step_time_fit") or {}, thr.get("offload_exposed") or {}
    if fit.get("error"):
        lines.append(f"step-time refit: not fitted: {fit['error']}")
    elif fit:
        lines.append(f"step-time refit from this check (profile lines: memory_gbps {fit['memory_gbps']:.0f}, "
                     f"compute_efficiency {fit['compute_efficiency']:.3f}; the profile's efficiency now "
                     f"{_fmt(fit.get('profile_compute_efficiency'), '.3f')}), against the untracked steps:")
        for r in fit.get("rows", []):
            lines.append(f"  {r['name']:<19}step {_fmt(r['measured_s'], '.4f')} s  plan {_fmt(r.get('planned_s'), '.4f')} s "
                         f"({_pct(r.get('rel_err'))})  refit {_fmt(r['refit_s'], '.4f')} s ({_pct(r.get('refit_rel_err'))})  "
                         f"memory-bound {r['op_bytes'] / 1e9:.1f} GB")
    if exp:
        lines.append(f"ZeRO-Offload's copies to the host: planned {_fmt(exp['planned_offload_s'], '.4f')} s, shown "
                     f"{_fmt(exp['shown_s'], '.4f')} s ({_pct(exp['shown_fraction']).lstrip('+')} of the plan; its untracked "
                     "forward and backward less plain's, each its step less its optimizer step)")
    return lines


def _profile_lines(runs: list[dict]) -> list[str]:
    """A profiled run's phases and its ops with the most self time (trainer.profile_step), ms."""
    lines = []
    for r in runs:
        p = r.get("profile")
        if not p:
            continue
        def ms(row, key):
            return "-" if not row or row.get(key) is None else f"{row[key] / 1e3:.1f}"
        ph = p.get("phases") or {}
        fb, opt = ph.get("forward_backward"), ph.get("optimizer_step")
        key = p.get("sorted_by", "self_cpu_us")
        lines.append(f"  {r.get('name')} step {p.get('step')} profiled, ms: forward+backward host {ms(fb, 'cpu_us')} device "
                     f"{ms(fb, 'device_us')}, optimizer step host {ms(opt, 'cpu_us')} device {ms(opt, 'device_us')}; most "
                     f"{key.replace('_us', '').replace('_', ' ')}: "
                     + ", ".join(f"{o['name']} x{o['calls']} {o[key] / 1e3:.1f}" for o in p.get("top_ops", [])[:5]))
    return lines
