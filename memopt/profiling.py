"""One training step under ``torch.profiler`` (``trainer.profile_step=N``): where a step's time goes, by op and by
phase, on every rank.

Why: a step time says how long, not where. The GPU check measured DeepSpeed's ZeRO-Offload step 0.076 s longer
than memopt's outside the optimizer step and could not say which ops hold it (experiments/offload_step); torchtitan
and DeepSpeed users profile a step for the same question. The trainer marks its phases with
``record_function`` (``PHASES``, entered in the profiled step only), and this writes, per rank, into
``<run dir>/profile/``:

* ``rank<r>_step<n>.json``: each phase's time and the ops with the most self time (device time on a GPU, host
  time on a CPU), what a script reads;
* ``rank<r>_step<n>.txt``: the same as a table, what a person reads (a phase's time in no op is Python and waits:
  a synchronous collective's wait counts as the self time of the op or phase that called it);
* ``rank<r>_step<n>.trace.json``: the Chrome trace (``trainer.profile_trace``; chrome://tracing or Perfetto).

The profiled step is left out of the run's step-time medians (the profiler slows it).
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings

import torch
from torch.autograd import DeviceType

PHASES = ("memopt.forward_backward", "memopt.optimizer_step")
TOP_OPS = 25


class StepProfiler:
    """``start(step)`` / ``stop(step)`` around each step: a profiler runs for ``profile_step`` only."""

    def __init__(self, profile_step: int, run_dir: str, rank: int, device: torch.device, trace: bool = True,
                 tracked: bool = False):
        self.step, self.run_dir, self.rank, self.device, self.trace = profile_step, run_dir, rank, device, trace
        self.tracked = tracked  # the memory tracker's dispatch mode on: every op recorded twice
        self._prof, self.error = None, None

    def start(self, step: int) -> None:
        if step != self.step:
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        try:
            self._prof = profile(activities=acts)
            self._prof.__enter__()
        except Exception as e:  # noqa: BLE001 - a profiler that cannot start (no CUPTI, another one running): the run goes on
            self._prof, self.error = None, f"{type(e).__name__}: {e}"
            warnings.warn(f"trainer.profile_step={step}: the profiler did not start ({self.error}); the run goes on", stacklevel=2)

    def phase(self, name: str):
        """A ``record_function`` range while this step is profiled; nothing otherwise (every other step's hot path
        dispatches no profiler op)."""
        return torch.profiler.record_function(name) if self._prof is not None else contextlib.nullcontext()

    def stop(self, step: int) -> dict | None:
        """The written record's summary (its paths and phases), or None when this step was not profiled; a profiler
        that failed says so (``error``) and the run goes on."""
        if step != self.step:
            return None
        if self._prof is None:
            return {"files": [], "phases": {}, "error": self.error or "the profiler did not start"}
        prof, self._prof = self._prof, None
        try:
            return self._write(prof, step)
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"trainer.profile_step={step}: the profile was not written ({type(e).__name__}: {e}); the run "
                          "goes on", stacklevel=2)
            return {"files": [], "phases": {}, "error": f"{type(e).__name__}: {e}"}

    def close(self) -> None:
        """Stop a profiler a raising step left running (torch allows one at a time in a process)."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            try:
                prof.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - the run's own error is the one to report
                pass

    def _write(self, prof, step: int) -> dict:
        prof.__exit__(None, None, None)
        rec = summarize(prof.key_averages(), self.device.type == "cuda")
        rec.update(step=step, rank=self.rank)
        if self.tracked:
            rec["note"] = ("the memory tracker was on: its dispatch mode sends every op through twice, so the calls count "
                           "double and PythonDispatchMode's time is the tracker's; trainer.track_memory=false profiles "
                           "the step without it")
        d = os.path.join(self.run_dir, "profile")
        os.makedirs(d, exist_ok=True)
        base = os.path.join(d, f"rank{self.rank}_step{step}")
        with open(base + ".json", "w") as f:
            json.dump(rec, f, indent=1)
        with open(base + ".txt", "w") as f:
            f.write(format_table(rec))
        rec["files"] = [base + ".json", base + ".txt"]
        if self.trace:
            prof.export_chrome_trace(base + ".trace.json")
            rec["files"].append(base + ".trace.json")
        return rec


def _device_us(evt, self_only: bool) -> float:
    """An event's device time in us (torch names it device_time since 2.4; cuda_time before)."""
    name = "self_device_time_total" if self_only else "device_time_total"
    if not hasattr(evt, name):
        name = "self_cuda_time_total" if self_only else "cuda_time_total"
    return float(getattr(evt, name, 0.0) or 0.0)


def _on_device_side(evt) -> bool:
    """A kernel, a copy or a range on the GPU's timeline (kineto's events of device type CUDA), not a host-side op."""
    return getattr(evt, "device_type", DeviceType.CPU) != DeviceType.CPU


def summarize(averages, on_device: bool) -> dict:
    """The phases' times and the ``TOP_OPS`` ops with the most self time (``self_device_us`` on a GPU, else
    ``self_cpu_us``), in us, from ``profile.key_averages()``.

    With CUDA, kineto gives each kernel and copy a row of its own on the device's timeline beside the host op that
    launched it (whose self device time is those kernels'), and each ``record_function`` range a second row there
    (a user annotation: its span). So, as torch's own table does: the ops listed are the host-side ones, their total
    is the device-side rows that are not annotations, and a phase keeps its host row's times with the device span of
    its annotation row."""
    phases, ops, device_total = {}, [], 0.0
    for e in averages:
        side, annotation = _on_device_side(e), bool(getattr(e, "is_user_annotation", False))
        if e.key in PHASES:
            row = phases.setdefault(e.key.split(".", 1)[1], {"name": e.key})
            if side:
                row["device_span_us"] = _device_us(e, False)
            else:
                row.update(calls=int(e.count), self_cpu_us=float(e.self_cpu_time_total), cpu_us=float(e.cpu_time_total),
                           **({"device_us": _device_us(e, False)} if on_device else {}))
            continue
        if side:
            if not annotation:
                device_total += _device_us(e, True)
            continue
        row = {"name": e.key, "calls": int(e.count), "self_cpu_us": float(e.self_cpu_time_total),
               "cpu_us": float(e.cpu_time_total)}
        if on_device:
            row.update(self_device_us=_device_us(e, True), device_us=_device_us(e, False))
        ops.append(row)
    key = "self_device_us" if on_device else "self_cpu_us"
    ops.sort(key=lambda r: r[key], reverse=True)
    total = (device_total or sum(r[key] for r in ops)) if on_device else sum(r[key] for r in ops)
    return {"sorted_by": key, "phases": phases, "top_ops": ops[:TOP_OPS], "total_self_us": total}


def format_table(rec: dict) -> str:
    key = rec["sorted_by"]
    lines = [f"step {rec.get('step')} on rank {rec.get('rank')}: phases (host time, device time where measured), "
             f"then the ops with the most {key.replace('_us', '').replace('_', ' ')} (us)"]
    if rec.get("note"):
        lines.append(f"note: {rec['note']}")
    for name, r in rec["phases"].items():
        lines.append(f"  {name:<20} host {r.get('cpu_us', 0):>12,.0f} (in no op: {r.get('self_cpu_us', 0):,.0f}: Python, waits)"
                     + (f"  device {r['device_us']:>12,.0f}" if "device_us" in r else "")
                     + (f" (span {r['device_span_us']:,.0f})" if "device_span_us" in r else ""))
    lines.append(f"{'op':<60}{'calls':>8}{key:>16}{'share':>8}")
    total = rec["total_self_us"] or 1.0
    for r in rec["top_ops"]:
        lines.append(f"{r['name'][:59]:<60}{r['calls']:>8}{r[key]:>16,.0f}{100 * r[key] / total:>7.1f}%")
    return "\n".join(lines) + "\n"
