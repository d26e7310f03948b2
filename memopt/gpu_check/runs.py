"""The compositions and throughput sections: every composition planned in the background (fake tensors, on
the CPU) and trained for a few steps; planned against measured device peak and step time; each rerun without
the memory tracker."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

from memopt.gpu_check import fit
from memopt.gpu_check.fit import rel_err
from memopt.gpu_check.check import Check, SkipSection
from memopt.gpu_check.procs import kill_group, run_cmd, spawn, tail
from memopt.gpu_check.settings import (COMMON, COMPOSITIONS, DEEPSPEED_COMPOSITION, DRY_HARDWARE, DRY_MODEL, DRY_SUBST,
                                       DRY_TRAIN_STEPS, GPU_PROFILES, HARDWARE, MODEL, RUN_MIN_DEFAULT_S, RUN_MIN_S,
                                       TRAIN_STEPS, WARMUP_STEPS)


def _env(check) -> dict:
    return ((check.results.get("sections") or {}).get("env") or {}).get("result") or {}


def compositions(check) -> list[tuple[str, list[str]]]:
    """The compositions this check trains: DeepSpeed's ZeRO-Offload too where the env section imported it."""
    return [*COMPOSITIONS, *([DEEPSPEED_COMPOSITION] if str(_env(check).get("deepspeed", "")).startswith("ok") else [])]


def hardware_args(gpu_name: str | None) -> list[str]:
    """The hardware profile of the GPU the env section found (settings.GPU_PROFILES, a tag matched as a whole word
    of the name; an H100's otherwise)."""
    words = re.findall(r"[A-Za-z0-9]+", str(gpu_name or ""))
    profile = next((p for tag, p in GPU_PROFILES if tag in words), None)
    return HARDWARE if profile is None else [f"hardware={profile}", *HARDWARE[1:]]


def composition_args(name: str, overrides: list[str], dry: bool, gpu_name: str | None = None) -> list[str]:
    if dry:
        overrides = [DRY_SUBST.get(o, o) for o in overrides]
        return [*DRY_MODEL, *DRY_HARDWARE, *COMMON, *overrides]
    return [*MODEL, *hardware_args(gpu_name), *COMMON, *overrides]


def start_plans(check: Check) -> dict:
    """Start every composition's plan (fake tensors, CPU only) in the background; collected later."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # plans never touch the GPU the other sections time
    started = []
    for name, ov in compositions(check):
        d = os.path.join(check.work, f"plan_{name}")
        shutil.rmtree(d, ignore_errors=True)
        cmd = [sys.executable, "-m", "memopt.train", *composition_args(name, ov, check.mode != "cuda", _env(check).get("gpu")),
               "trainer.mode=plan", f"hydra.run.dir={d}"]
        log = check.log_path(f"plan_{name}")
        p = spawn(cmd, log, env)
        check.background[f"plan_{name}"] = (p, {"dir": d, "log": log, "t0": time.monotonic(), "cmd": cmd})
        started.append(name)
    # the host Adam's C++ kernel (zero2_offload, the chunk engine) builds once, here, not in a timed run
    log = check.log_path("cpu_adam_build")
    p = spawn([sys.executable, "-c", "from memopt.optim.cpu_adam import load_kernel, kernel_error; "
               "load_kernel(); print('cpu_adam kernel:', kernel_error() or 'built')"], log, env)
    check.background["cpu_adam_build"] = (p, {"log": log, "t0": time.monotonic()})
    if DEEPSPEED_COMPOSITION in compositions(check):  # DeepSpeed's own CPU Adam op, built once (JIT, ninja)
        log = check.log_path("deepspeed_cpu_adam_build")
        p = spawn([sys.executable, "-c", "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); "
                   "print('deepspeed cpu_adam: built')"], log, dict(os.environ))
        check.background["deepspeed_cpu_adam_build"] = (p, {"log": log, "t0": time.monotonic()})
    return {"started": started}


def wait_plan(check: Check, name: str, deadline: float) -> dict:
    p, meta = check.background[f"plan_{name}"]
    try:
        rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        kill_group(p)
        return {"plan_status": "timeout", "plan_error": tail(meta["log"], 500)}
    out: dict = {"plan_rc": rc, "plan_seconds": round(time.monotonic() - meta["t0"], 1)}
    plan = _read_json(os.path.join(meta["dir"], "plan.json"))
    if plan is None:
        out["plan_status"] = "error"
        out["plan_error"] = tail(meta["log"], 800)
        return out
    out["plan_status"] = plan.get("status")
    dev = _rank0(plan.get("peak_bytes"), prefer="device")
    host = _rank0(plan.get("peak_bytes"), prefer="host", only=True)
    out["planned_device_bytes"] = (dev or {}).get("total")
    # the plan's device need: its tensors (what the tracker counts) + the libraries' workspaces (what the
    # caching allocator holds beside them), compared with max_memory_allocated
    out["planned_device_runtime_bytes"] = plan.get("device_runtime_bytes", 0)
    if out["planned_device_bytes"] is not None:
        out["planned_device_need_bytes"] = out["planned_device_bytes"] + out["planned_device_runtime_bytes"]
    out["planned_device_categories"] = dev
    out["planned_host_bytes"] = (host or {}).get("total")
    st = plan.get("step_time") or {}
    out["planned_step_s"] = st.get("total_s")
    out["planned_step_terms"] = {k: st.get(k) for k in ("compute_s", "offload_s", "comm_s", "optimizer_s", "dominant", "peak_tflops",
                                                       "compute_efficiency", "host_optim_params", "memory_s", "overhead_s",
                                                       "attention_efficiency", "bubble_fraction")}
    out["planned_op_bytes"] = (plan.get("traffic") or {}).get("op_bytes")  # the memory-bound bytes (fit.py)
    if plan.get("suggestion"):
        out["plan_suggestion"] = plan.get("suggestion")
    return out


PROFILE_TOP = 8  # ops of a profiled step kept in gpu_check.json
PROFILED = ("zero2_offload", DEEPSPEED_COMPOSITION[0])  # DeepSpeed's step was 0.076 s longer outside its optimizer


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _rank0(peaks, prefer: str, only: bool = False):
    """Rank 0's per-category peaks on the memory ``prefer`` ("device": the plan's key; a measured
    summary names the device itself, "cuda:0" or "cpu")."""
    if not isinstance(peaks, dict):
        return None
    r0 = peaks.get("0") or (next(iter(peaks.values())) if peaks else None)
    if not isinstance(r0, dict):
        return None
    if prefer in r0:
        return r0[prefer]
    if only:
        return None
    for key in r0:
        if key.startswith("cuda"):
            return r0[key]
    keys = [k for k in r0 if k != "host"]
    return r0[keys[0]] if keys else None


def run_timeout(name: str, left: float, share: float) -> float:
    """A run's time: 1.6x its share of what the section has left (the first ones get what a run takes, the cap cuts
    the last ones), at least the composition's least (settings.RUN_MIN_S), never past what is left."""
    return min(left, max(share * 1.6, RUN_MIN_S.get(name, RUN_MIN_DEFAULT_S)))


def train_run(check: Check, name: str, overrides: list[str], steps: int, timeout: float, extra: list[str] = ()) -> dict:
    d = os.path.join(check.work, f"run_{name}")
    shutil.rmtree(d, ignore_errors=True)
    dry = check.mode != "cuda"
    cmd = [sys.executable, "-m", "memopt.train", *composition_args(name, overrides, dry, _env(check).get("gpu")),
           f"trainer.max_steps={steps}", "trainer.log_every=1", *extra, f"hydra.run.dir={d}"]
    if dry:
        cmd.append("trainer.throughput_warmup_steps=0")
    log = check.log_path(f"train_{name}")
    r = run_cmd(cmd, timeout, log, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out: dict = {"name": name, "overrides": overrides, "rc": r["rc"], "seconds": r["seconds"]}
    s = _read_json(os.path.join(d, "summary.json"))
    if s is None:
        out["status"] = "timeout" if r["timed_out"] else "error"
        out["error"] = tail(log, 800)
        return out
    out["status"] = s.get("status")
    if s.get("error"):
        out["error"] = s["error"]
    for key in ("tokens_per_s", "tflops", "mfu", "step_time_s", "optim_step_s", "peak_tflops_per_device", "tokens_per_step",
                "params", "final_loss", "engine", "strategy", "hardware"):
        out[key] = s.get(key)
    out.update(step_spread(os.path.join(d, "metrics.jsonl"), 0 if dry else WARMUP_STEPS))
    dev = _rank0(s.get("peak_bytes"), prefer="device")
    out["tracker_device_bytes"] = (dev or {}).get("total")
    out["tracker_device_categories"] = dev
    out["tracker_host_bytes"] = (_rank0(s.get("peak_bytes"), prefer="host", only=True) or {}).get("total")
    prof = s.get("profile") or {}
    rec = _read_json(next((f for f in prof.get("files", []) if f.endswith(".json") and "trace" not in f), ""))
    if rec:  # the profiled step (trainer.profile_step): its phases and the ops with the most device time
        out["profile"] = {"step": prof.get("step"), "phases": rec.get("phases"), "sorted_by": rec.get("sorted_by"),
                          "top_ops": rec.get("top_ops", [])[:PROFILE_TOP]}
    alloc = s.get("cuda_allocator_peak") or {}
    out["allocator_peak_bytes"] = alloc.get("0")
    out["allocator_reserved_peak_bytes"] = (s.get("cuda_allocator_reserved_peak") or {}).get("0")
    return out


def step_spread(metrics_path: str, warmup: int) -> dict:
    """The timed steps' fastest and slowest step and their spread ((max - min) / median) from metrics.jsonl
    (every step logged): whether a planned-vs-measured difference is larger than the run's own noise."""
    times = []
    try:
        with open(metrics_path) as f:
            for line in f:
                rec = json.loads(line)
                if "step_time_s" in rec and rec.get("step", 0) >= warmup:
                    times.append(rec["step_time_s"])
    except (OSError, ValueError):
        return {}
    if not times:
        return {}
    med = sorted(times)[len(times) // 2]
    return {"timed_steps": len(times), "step_time_min_s": min(times), "step_time_max_s": max(times),
            "step_time_spread": (max(times) - min(times)) / med if med else None}


def section_compositions(check: Check, cap: float, rec: dict) -> dict:
    deadline = time.monotonic() + cap
    if not any(k.startswith("plan_") for k in check.background):
        start_plans(check)
    runs = []
    dry = check.mode != "cuda"
    steps = DRY_TRAIN_STEPS if dry else TRAIN_STEPS
    comps = compositions(check)
    for i, (name, ov) in enumerate(comps):
        left = deadline - time.monotonic()
        share = left / (len(comps) - i)
        if left < 8:
            runs.append({"name": name, "status": "skipped", "error": "the section's cap was reached"})
            continue
        try:
            r = train_run(check, name, ov, steps, run_timeout(name, left, share))
            r.update(wait_plan(check, name, min(deadline, time.monotonic() + 30)))
            r["rel_err_tracker"] = rel_err(r.get("planned_device_bytes"), r.get("tracker_device_bytes"))
            r["rel_err_allocator"] = rel_err(r.get("planned_device_need_bytes"), r.get("allocator_peak_bytes"))
            r["rel_err_host"] = rel_err(r.get("planned_host_bytes"), r.get("tracker_host_bytes"))
            r["rel_err_step_time"] = rel_err(r.get("planned_step_s"), r.get("step_time_s"))
        except Exception as exc:  # noqa: BLE001
            r = {"name": name, "status": "error", "error": f"{type(exc).__name__}: {exc}"}
        runs.append(r)
        rec["result"] = {"runs": runs}
        check.write()
    res: dict = {"runs": runs, "model": DRY_MODEL if dry else MODEL, "hardware": DRY_HARDWARE if dry else hardware_args(_env(check).get("gpu")),
                 "common": COMMON, "train_steps": steps,
                 "note": "rel err = (planned - measured) / measured; measured device peak: the tracker's (what the planner "
                         "predicts) and torch.cuda.max_memory_allocated (the caching allocator's); step time: the trainer's "
                         "median after warm-up, with the memory tracker on"}
    for key in ("cpu_adam_build", "deepspeed_cpu_adam_build"):
        bg = check.background.get(key)
        if bg is not None:
            res[key] = (tail(bg[1]["log"], 400).strip().splitlines() or ["(no output)"])[-1] if bg[0].poll() is not None \
                else "still building"
    zo = next((r for r in runs if r.get("name") == "zero2_offload"), None)
    ds = next((r for r in runs if r.get("name") == DEEPSPEED_COMPOSITION[0]), None)
    if zo:
        res["zero_offload"] = {"engine": "memopt", "step_time_s": zo.get("step_time_s"), "optim_step_s": zo.get("optim_step_s"),
                               "planned_step_s": zo.get("planned_step_s"),
                               "planned_offload_s": (zo.get("planned_step_terms") or {}).get("offload_s"),
                               "tokens_per_s": zo.get("tokens_per_s"), "status": zo.get("status"),
                               "note": "host gradients go over the CUDA side stream (memopt/optim/host_grads.py); "
                                       + ("DeepSpeed's ZeRO-Offload beside it (deepspeed)" if ds else
                                          "memopt alone: DeepSpeed is not importable on this machine (carry its wheels: "
                                          "make gpu-wheels), so no DeepSpeed ZeRO-Offload number beside it")}
        if ds:
            res["zero_offload"]["deepspeed"] = {k: ds.get(k) for k in ("status", "step_time_s", "optim_step_s", "tokens_per_s",
                                                                       "planned_step_s", "tracker_device_bytes",
                                                                       "allocator_peak_bytes", "tracker_host_bytes")}
            if zo.get("step_time_s") and ds.get("step_time_s"):
                res["zero_offload"]["memopt_speedup_over_deepspeed"] = ds["step_time_s"] / zo["step_time_s"]
    if any(r.get("status") != "ok" for r in runs):
        res["_status"] = "partial"
    return res


def _offload_pair(runs: list[dict]) -> dict:
    """memopt's and DeepSpeed's ZeRO-Offload untracked, where both reran: their steps and memopt's speed-up."""
    by = fit.timed_runs(runs)
    mo, ds = by.get("zero2_offload"), by.get(DEEPSPEED_COMPOSITION[0])
    if not (mo and ds):
        return {}
    return {"zero_offload_untracked": {"memopt_step_s": mo["step_time_s"], "deepspeed_step_s": ds["step_time_s"],
                                       "memopt_optim_step_s": mo.get("optim_step_s"),
                                       "deepspeed_optim_step_s": ds.get("optim_step_s"),
                                       "memopt_speedup_over_deepspeed": ds["step_time_s"] / mo["step_time_s"]}}


def section_throughput(check: Check, cap: float, rec: dict) -> dict:
    """Every composition that trained above, rerun without the memory tracker: plain bf16 first, then memopt's and
    DeepSpeed's ZeRO-Offload, then by tracked tokens/s (what the cap cuts is the slowest). The planner's step is
    compared with both steps, so a plan's error splits into the tracker's cost (a dispatch mode on every op, which
    runs do not need) and the model's own (GPU step plans read 11-37% under tracked steps in the first six checks;
    untracked, plain bf16 read +3%); the two ZeRO-Offloads are compared untracked too (the tracker's share of a
    step differs by composition: 22-59% on the seventh check's H200)."""
    comps = (((check.results["sections"].get("compositions") or {}).get("result")) or {}).get("runs") or []
    ok = [r for r in comps if r.get("status") == "ok" and r.get("tokens_per_s")]
    if not ok:
        raise SkipSection("no composition trained successfully above")
    first = ("plain_bf16", "zero2_offload", DEEPSPEED_COMPOSITION[0])
    order = sorted(ok, key=lambda r: (first.index(r["name"]) if r["name"] in first else len(first), -r["tokens_per_s"]))
    best = max(ok, key=lambda r: r["tokens_per_s"])
    deadline = time.monotonic() + cap
    dry = check.mode != "cuda"
    overrides = dict(compositions(check))
    runs = []
    for i, tracked in enumerate(order):
        name = tracked["name"]
        left = deadline - time.monotonic()
        if left < 8:
            runs.append({"name": name, "status": "skipped", "error": "the section's cap was reached"})
            continue
        share = left / (len(order) - i)
        steps = DRY_TRAIN_STEPS if dry else TRAIN_STEPS
        extra = ["trainer.track_memory=false"]
        if name in PROFILED:  # where the two ZeRO-Offloads' time goes: their last step profiled (out of the median)
            extra += [f"trainer.profile_step={steps - 1}", "trainer.profile_trace=false"]
        try:  # the first ones get the time a run takes (the cap cuts the last ones, not every one)
            r = train_run(check, f"{name}_untracked", overrides[name], steps, run_timeout(name, left, share), extra=extra)
        except Exception as exc:  # noqa: BLE001
            r = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        r["name"] = name
        r["planned_step_s"] = tracked.get("planned_step_s")
        r["tracked_step_s"] = tracked.get("step_time_s")
        r["rel_err_step_time"] = rel_err(r["planned_step_s"], r.get("step_time_s"))
        r["tracker_cost"] = rel_err(tracked.get("step_time_s"), r.get("step_time_s"))  # tracked / untracked - 1
        runs.append(r)
        rec["result"] = {"runs": runs}
        check.write()
    gbps = (_env(check).get("memory_bandwidth") or {}).get("gbps")
    res = {"runs": runs, "best_tracked": best["name"],
           **_offload_pair(runs),
           "step_time_fit": fit.step_time_fit(gbps, comps, runs),
           "offload_exposed": fit.offload_exposed(comps, runs),
           "note": "every composition that trained above (plain first, then memopt's and DeepSpeed's ZeRO-Offload, then by "
                   "tracked tokens/s) rerun with "
                   "trainer.track_memory=false; rel err = (planned - untracked) / untracked; tracker cost = tracked / "
                   "untracked step - 1; MFU against the hardware profile's dense peak"}
    if any(r.get("status") != "ok" for r in runs):
        res["_status"] = "partial"
    return res
