"""A prepared GPU check: the first measurements of memopt on a real accelerator, in a few minutes.

``make gpu-check OUT=dir`` (or ``python3 -m memopt.gpu_check dir``) on a GPU machine without network
access, from the repository root. It needs only the machine's own ``python3`` with torch and triton
(any recent release: nothing of memopt's own virtual environment); the pure-Python packages memopt
needs beyond those (hydra-core, omegaconf, antlr4) come as wheels in ``.whl/`` (``make gpu-wheels``,
run where pip reaches a registry) and are installed into a temporary target directory, put on
``sys.path`` and on ``PYTHONPATH`` for the subprocesses.

On a machine without CUDA it prints one line and exits 0. On CUDA it runs, within a global time
budget (``--budget``, default 420 s), each section with its own cap:

* ``env``: GPU, driver, torch / triton / Python versions, the wheel install, ``import memopt.train``;
* ``tests``: the kernel tests (``tests/kernels``) compiled for the GPU (``TRITON_INTERPRET=0``, fixed
  tiles: ``MEMOPT_FLASH_NO_AUTOTUNE=1``, which keeps the compile count small), ``test_bf16_cuda``
  included, and the tests marked ``cuda`` elsewhere;
* ``flash``: memopt's Triton FlashAttention (autotuned, as training runs it) forward + backward
  against PyTorch SDPA's flash backend, fp16 and bf16, head dim 64 and 128, causal, N = 1024, 4096,
  16384: max abs error of the output and of dq, dk, dv against an fp32 reference (SDPA's math
  backend on fp32 copies), median time (CUDA events), TFLOP/s and peak bytes of both;
* ``compositions``: five compositions on one GPU (six with DeepSpeed's), each planned (``trainer.mode=plan``, fake tensors,
  started in the background at the beginning) and trained for a few steps: planned vs measured
  device peak (the tracker's and ``torch.cuda.max_memory_allocated``), planned vs measured step time,
  the relative errors; the ZeRO-Offload step time, beside DeepSpeed's where its wheels travelled (``make
  gpu-wheels`` puts them in .whl/; DeepSpeed's CPU Adam op is built in the background);
* ``throughput``: tokens/s and MFU of the plain composition and the fastest one, rerun without the
  memory tracker.

Every section runs in its own ``try`` and (where it touches the GPU) in its own subprocess with a
timeout; ``gpu_check.json`` and ``gpu_check.txt`` are rewritten after every section, so a section
that fails or hangs loses nothing else. ``gpu_check_logs.txt`` holds the tail of every subprocess's
output. Exit code 0 whatever the results (they are in the files); 2 only for bad arguments.

``--cpu-dry-run`` runs the same orchestration on a CPU (tiny model, CUDA-only parts skipped with
their reason): it is how the plumbing is tested without a GPU (``tests/unit/test_gpu_check.py``).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

from memopt.logging import atomic_write_bytes
from memopt.planner.plan import fmt as _fmt_bytes  # the plan table's byte format ("-" for a missing value)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = 1
SECTIONS = ("env", "tests", "flash", "compositions", "throughput")
# Each section's own cap (seconds); the global budget trims the later ones.
CAPS = {"env": 30, "tests": 130, "flash": 90, "compositions": 130, "throughput": 40}
DEFAULT_BUDGET_S = 420.0
RESERVE_S = 5.0  # kept back from every section for writing the results
CUDA_MARKED_S = 35.0  # the tests section's time kept for the tests marked cuda after the compiled kernel tests
MIN_SECTION_S = 10.0  # a section with less than this left is skipped ("global budget spent")

# The compositions compared with the planner. One model for all: gpt_1b's width (d_model 2048, 16
# heads of 128, seq 2048, vocab 50304) at 4 layers (0.31B params): fits easily, a step takes tens of
# milliseconds. The chunk engine's device budget (2.5 GB) is below the model's 16 B/param of states
# (5 GB); its micro-batch is 1 because its budget must also hold the non-model memory (the planner's
# own suggestion for this case).
MODEL = ["model=gpt_1b", "model.n_layer=4", "trainer.micro_batch_size=4"]
HARDWARE = ["hardware=h100_sxm", "hardware.host_memory_gb=120"]
COMMON = ["logger=none", "trainer.eval_every=0", "trainer.save_checkpoint=false", "trainer.progress_bar=false"]
COMPOSITIONS = [
    ("plain_bf16", ["+strategy=bf16"]),
    ("bf16_ckpt", ["+strategy=[bf16,ckpt]"]),
    ("zero2_offload", ["+strategy=[bf16,zero2,cpu_offload]"]),
    ("chunk_hybrid_adam", ["+strategy=[hybrid_adam,ckpt]", "strategy.chunk.device_budget_gb=2.5",
                           "strategy.chunk.warmup_gpu_chunk_mem_ratio=0.6", "trainer.micro_batch_size=1"]),
    ("chunked_loss", ["+strategy=[bf16,chunked_loss]"]),
]
# DeepSpeed's ZeRO-Offload beside memopt's, where deepspeed imports (its wheels travel in .whl/: `make gpu-wheels`)
DEEPSPEED_COMPOSITION = ("ds_zero2_offload", ["engine=deepspeed", "+strategy=[bf16,zero2,cpu_offload]"])
TRAIN_STEPS = 12  # 3 warm-up steps, the median of the other 9 and their spread (tracked steps moved 10-35% between
# calls minutes apart on the first H100 check: one median of 5 could not tell a change from noise)
WARMUP_STEPS = 3  # the trainer's throughput_warmup_steps
# --cpu-dry-run: the same compositions on gpt_tiny (the chunk budget scaled down with it)
DRY_MODEL = ["model=gpt_tiny", "trainer.micro_batch_size=2"]
DRY_HARDWARE = ["hardware=h100_sxm", "hardware.host_memory_gb=120"]
DRY_SUBST = {"strategy.chunk.device_budget_gb=2.5": "strategy.chunk.device_budget_gb=0.01"}
DRY_TRAIN_STEPS = 2

# FlashAttention cases: (dtype, head dim) groups in this order (bf16 x 128 is gpt_1b's), each at every N.
FLASH_GROUPS = [("bfloat16", 128), ("float16", 64), ("bfloat16", 64), ("float16", 128)]
FLASH_NS = (1024, 4096, 16384)
FLASH_TOKENS = 131072  # batch * heads * N: 128 heads at N=1024, 32 at 4096, 8 at 16384
FLASH_WARMUP, FLASH_REPS = 2, 5
FLASH_QUEUED = 10  # calls per timing when queued (see _bench_one.timed)


class SkipSection(Exception):
    """A section that cannot run here; its message is the stated reason."""


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ----------------------------------------------------------------------------------------------
# CUDA detection and the wheel install
# ----------------------------------------------------------------------------------------------
def detect_cuda() -> tuple[bool, str]:
    """(True, device name) on a CUDA machine, else (False, why)."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return False, f"torch cannot be imported ({type(exc).__name__}: {exc})"
    try:
        if not torch.cuda.is_available():
            return False, f"torch {torch.__version__} sees no CUDA device"
        return True, torch.cuda.get_device_name(0)
    except Exception as exc:  # noqa: BLE001
        return False, f"torch {torch.__version__}: CUDA query failed ({type(exc).__name__}: {exc})"


def install_wheels(wheel_dir: str, target: str, python: str = sys.executable, timeout: float = 120,
                   pip_args: tuple[str, ...] = ()) -> dict:
    """``pip install --no-index --no-deps --target`` every wheel of ``wheel_dir``; put ``target`` on
    ``sys.path`` and ``PYTHONPATH`` (with the repository, for the subprocesses) and its ``bin`` on ``PATH``.
    ``pip_args``: e.g. the GPU machine's Python tags, to install its binary wheels from another Python (a test).
    Returns a record."""
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    rec = {"wheel_dir": wheel_dir, "target": target, "wheels": [os.path.basename(w) for w in wheels]}
    if wheels:
        cmd = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", target, *pip_args, *wheels]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rec["rc"] = p.returncode
        if p.returncode != 0:
            rec["error"] = (p.stderr or p.stdout)[-2000:]
    else:
        rec["rc"] = None
        rec["error"] = f"no wheels in {wheel_dir} (run `make gpu-wheels` where pip reaches a registry)"
    add_paths([REPO, target])
    bin_dir = os.path.join(target, "bin")  # console scripts: ninja, which DeepSpeed's op builds run
    if os.path.isdir(bin_dir) and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    return rec


def compositions(check) -> list[tuple[str, list[str]]]:
    """The compositions this check trains: DeepSpeed's ZeRO-Offload too where the env section imported it."""
    env = ((check.results.get("sections") or {}).get("env") or {}).get("result") or {}
    return [*COMPOSITIONS, *([DEEPSPEED_COMPOSITION] if str(env.get("deepspeed", "")).startswith("ok") else [])]


def add_paths(paths: list[str]) -> None:
    """Prepend ``paths`` to this process's ``sys.path`` and to ``PYTHONPATH`` (subprocesses)."""
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in paths]
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *old])


# ----------------------------------------------------------------------------------------------
# Subprocesses with a timeout (a process group, killed whole on timeout)
# ----------------------------------------------------------------------------------------------
_LIVE: set = set()  # every subprocess started here and not yet reaped (killed on SIGTERM / SIGINT)


def spawn(cmd: list[str], log: str, env: dict | None = None, cwd: str = REPO) -> subprocess.Popen:
    """A subprocess in its own process group (killed whole at its cap), output into ``log``."""
    with open(log, "wb") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
    _LIVE.add(p)
    return p


def run_cmd(cmd: list[str], timeout: float, log: str, env: dict | None = None, cwd: str = REPO) -> dict:
    t0 = time.monotonic()
    p = spawn(cmd, log, env, cwd)
    timed_out = False
    try:
        rc = p.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(p)
        rc = p.wait()
    _LIVE.discard(p)
    return {"rc": rc, "timed_out": timed_out, "seconds": round(time.monotonic() - t0, 2)}


def kill_all() -> None:
    for p in list(_LIVE):
        if p.poll() is None:
            _kill_group(p)
        _LIVE.discard(p)


def _kill_group(p: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            p.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


# ----------------------------------------------------------------------------------------------
# Results: gpu_check.json (the record), gpu_check.txt (a short table), gpu_check_logs.txt
# ----------------------------------------------------------------------------------------------
def _atomic_write(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def write_results(out: str, results: dict) -> None:
    """Write gpu_check.json and gpu_check.txt from ``results`` (see ``new_results``)."""
    os.makedirs(out, exist_ok=True)
    _atomic_write(os.path.join(out, "gpu_check.json"), json.dumps(results, indent=1, default=str) + "\n")
    _atomic_write(os.path.join(out, "gpu_check.txt"), format_text(results))


def new_results(budget_s: float, mode: str) -> dict:
    """The documented structure: ``sections`` maps each section's name to ``{status, seconds, cap_s,
    result | reason | error}``; status is ok, partial (some cases failed or were cut by the cap),
    error, timeout or skipped."""
    return {"schema": SCHEMA, "tool": "memopt.gpu_check", "mode": mode, "started": _now(), "finished": None,
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
        lines.append("throughput without the memory tracker:")
        for r in thr:
            lines.append(f"  {r.get('name', '?'):<19}{str(r.get('status')):<8}tokens/s {_fmt(r.get('tokens_per_s'), ',.0f')}  "
                         f"TFLOP/s {_fmt(r.get('tflops'), '.1f')}  MFU {_fmt(None if r.get('mfu') is None else 100 * r['mfu'], '.1f')}%  "
                         f"step {_fmt(r.get('step_time_s'), '.4f')} s" + (f"  error: {str(r['error'])[:100]}" if r.get("error") else ""))
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# The orchestration: sections in order, each capped, the whole within a budget
# ----------------------------------------------------------------------------------------------
class Check:
    def __init__(self, out: str, budget_s: float = DEFAULT_BUDGET_S, mode: str = "cuda", work: str | None = None,
                 clock=time.monotonic):
        self.out, self.budget_s, self.mode, self.clock = out, float(budget_s), mode, clock
        self.t0 = clock()
        self.work = work or tempfile.mkdtemp(prefix="memopt-gpu-check-")
        self.results = new_results(self.budget_s, mode)
        self.results["work_dir"] = self.work  # subprocess logs and run directories (not copied out)
        self.background: dict[str, tuple[subprocess.Popen, dict]] = {}
        self.logs: list[str] = []
        os.makedirs(out, exist_ok=True)
        self.write()

    # time
    def elapsed(self) -> float:
        return self.clock() - self.t0

    def remaining(self) -> float:
        return self.budget_s - self.elapsed()

    def write(self) -> None:
        self.results["elapsed_s"] = round(self.elapsed(), 1)
        try:
            write_results(self.out, self.results)
        except Exception as exc:  # noqa: BLE001  (the results stay in memory; the next write tries again)
            print(f"gpu-check: could not write results: {exc}", file=sys.stderr)

    def log_path(self, name: str) -> str:
        path = os.path.join(self.work, re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".log")
        self.logs.append(path)
        return path

    def run_section(self, name: str, fn, cap_s: float) -> dict:
        cap = min(float(cap_s), self.remaining() - RESERVE_S)
        rec: dict = {"cap_s": round(max(cap, 0.0), 1)}
        self.results["sections"][name] = rec
        if cap < MIN_SECTION_S:
            rec.update(status="skipped", seconds=0.0, reason=f"global budget spent ({self.remaining():.0f} s left of {self.budget_s:.0f} s)")
            self.write()
            return rec
        rec["status"] = "running"
        self.write()
        t0 = self.clock()
        try:
            res = fn(self, cap, rec)
            rec["result"] = res
            rec["status"] = (res or {}).pop("_status", "ok") if isinstance(res, dict) else "ok"
            if isinstance(res, dict) and "_note" in res:
                rec["note"] = res.pop("_note")
        except SkipSection as exc:
            rec.update(status="skipped", reason=str(exc))
        except Exception as exc:  # noqa: BLE001  (recorded; the next section runs)
            rec.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(limit=8))
        rec["seconds"] = round(self.clock() - t0, 1)
        print(f"gpu-check: {name}: {rec['status']} in {rec['seconds']:.0f} s", flush=True)
        self.write()
        return rec

    def finish(self, status: str = "done") -> dict:
        for key, (p, meta) in list(self.background.items()):
            if p.poll() is None:
                _kill_group(p)
        kill_all()
        self.results["status"] = status
        self.results["finished"] = _now()
        self.write()
        self.write_logs()
        return self.results

    def write_logs(self) -> None:
        parts = []
        for path in self.logs:
            parts.append(f"===== {os.path.basename(path)} (last 6000 characters) =====\n{tail(path, 6000)}\n")
        try:
            _atomic_write(os.path.join(self.out, "gpu_check_logs.txt"), "".join(parts))
        except OSError:
            pass


# ---- env -------------------------------------------------------------------------------------
def section_env(check: Check, cap: float, rec: dict) -> dict:
    info: dict = {"python": sys.version.split()[0], "executable": sys.executable, "repo": REPO}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info.update(gpu=p.name, gpu_memory_bytes=p.total_memory, sm_count=p.multi_processor_count,
                        capability=f"{p.major}.{p.minor}", device_count=torch.cuda.device_count())
    except Exception as exc:  # noqa: BLE001
        info["torch_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        info["triton"] = f"missing ({type(exc).__name__}: {exc})"
    if shutil.which("nvidia-smi"):
        try:
            p = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            info["nvidia_smi"] = p.stdout.strip() or p.stderr.strip()
        except Exception as exc:  # noqa: BLE001
            info["nvidia_smi"] = f"failed: {exc}"
    info["cpu_count"] = os.cpu_count()
    info["wheels"] = check.results.get("wheels")
    # every module the check needs, imported in a fresh interpreter (what the subprocesses see)
    log = check.log_path("env_import")
    code = ("import memopt.train, memopt.api, memopt.planner.plan, memopt.engines, memopt.optim.host_grads; "
            "import hydra, omegaconf; print('hydra', hydra.__version__, 'omegaconf', omegaconf.__version__)")
    if check.mode == "cuda":
        code += "; import memopt.kernels.flash_attn"
    r = run_cmd([sys.executable, "-c", code], min(cap, 60), log)
    info["import_memopt_train"] = "ok" if r["rc"] == 0 else f"failed (rc {r['rc']}): {tail(log, 600).strip()}"
    ds_log = check.log_path("env_deepspeed")
    d = run_cmd([sys.executable, "-c", "import deepspeed; print(deepspeed.__version__)"], min(cap, 40), ds_log)
    info["deepspeed"] = (f"ok {tail(ds_log, 200).strip().splitlines()[-1]}" if d["rc"] == 0
                         else f"not importable: {(tail(ds_log, 300).strip().splitlines() or ['?'])[-1]}")
    if r["rc"] == 0:
        info["hydra_omegaconf"] = tail(log, 200).strip().splitlines()[-1]
    else:
        info["_status"] = "error"
    return info


# ---- background plans ------------------------------------------------------------------------
def composition_args(name: str, overrides: list[str], dry: bool) -> list[str]:
    if dry:
        overrides = [DRY_SUBST.get(o, o) for o in overrides]
        return [*DRY_MODEL, *DRY_HARDWARE, *COMMON, *overrides]
    return [*MODEL, *HARDWARE, *COMMON, *overrides]


def start_plans(check: Check) -> dict:
    """Start every composition's plan (fake tensors, CPU only) in the background; collected later."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # plans never touch the GPU the other sections time
    started = []
    for name, ov in compositions(check):
        d = os.path.join(check.work, f"plan_{name}")
        shutil.rmtree(d, ignore_errors=True)
        cmd = [sys.executable, "-m", "memopt.train", *composition_args(name, ov, check.mode != "cuda"),
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
        _kill_group(p)
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
                                                       "compute_efficiency", "host_optim_params")}
    if plan.get("suggestion"):
        out["plan_suggestion"] = plan.get("suggestion")
    return out


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


def _rel(planned, measured):
    if planned is None or not measured:
        return None
    return (planned - measured) / measured


# ---- tests -----------------------------------------------------------------------------------
_OUTCOMES = r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"
_RESULT_RE = re.compile(r"(\S+::\S+)\s+" + _OUTCOMES + r"\b")  # pytest -v: "tests/a.py::t PASSED [ 5%]"
_RESULT_RE2 = re.compile(_OUTCOMES + r"\s+(\S+::\S+)")  # pytest -v -n N: "[gw0] [ 5%] PASSED tests/a.py::t"


def parse_pytest(text: str) -> dict:
    """Counts per outcome from ``pytest -v -rfE`` output (partial output too), failures' short text."""
    seen: dict[str, str] = {}
    for line in text.splitlines():
        m = _RESULT_RE.search(line)
        if m:
            seen[m.group(1)] = m.group(2)
            continue
        m = _RESULT_RE2.search(line)
        if m:
            seen[m.group(2)] = m.group(1)
    counts: dict[str, int] = {}
    for v in seen.values():
        counts[v.lower()] = counts.get(v.lower(), 0) + 1
    failures = [line.strip()[:400] for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    last = ""
    for line in reversed(text.splitlines()):
        if re.search(r"\b(passed|failed|error|skipped|no tests ran|deselected)\b", line) and line.startswith("="):
            last = line.strip("= ").strip()
            break
    return {"counts": counts, "failures": failures[:40], "last_line": last, "outcomes": seen}


def cuda_marked_test_files(root: str = os.path.join(REPO, "tests"), exclude: str = "kernels") -> list[str]:
    out = []
    for path in sorted(glob.glob(os.path.join(root, "**", "test_*.py"), recursive=True)):
        if os.sep + exclude + os.sep in path:
            continue
        try:
            with open(path) as f:
                if "mark.cuda" in f.read():
                    out.append(os.path.relpath(path, REPO))
        except OSError:
            pass
    return out


def _pytest_run(check: Check, name: str, args: list[str], env: dict, timeout: float, workers: int = 1) -> dict:
    import importlib.util

    log = check.log_path(f"tests_{name}")
    extra = []  # (pyproject's addopts: -m 'not slow' -p no:cacheprovider)
    if importlib.util.find_spec("pytest_timeout") is not None:
        extra += ["--timeout", "120"]
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        extra += ["-n", str(workers)]  # Triton compiles in parallel (the tests' timings are not measurements)
    r = run_cmd([sys.executable, "-m", "pytest", "-v", "-rfE", *extra, *args], timeout, log, env=env)
    res = parse_pytest(tail(log, 400_000))
    res.update(rc=r["rc"], seconds=r["seconds"], timed_out=r["timed_out"], args=args)
    return res


def section_tests(check: Check, cap: float, rec: dict) -> dict:
    if check.mode != "cuda":
        raise SkipSection("no CUDA device: the compiled kernels and the tests marked cuda need one "
                          "(on a CPU they run under Triton's interpreter in the default suite)")
    deadline = time.monotonic() + cap
    res: dict = {}
    env = dict(os.environ, TRITON_INTERPRET="0", MEMOPT_FLASH_NO_AUTOTUNE="1", PYTHONUNBUFFERED="1")
    if "flash" in check.results.get("sections_planned", ()):
        start_flash_warm(check)  # compiles the autotuned kernels of the flash section meanwhile
    workers = max(1, min(4, (os.cpu_count() or 1) // 4))
    files = cuda_marked_test_files()
    # the CUDA-marked tests keep CUDA_MARKED_S of the cap (3 tests took 18.9 s on an H100; with 15 s kept, a
    # budget-trimmed cap cut them mid-run and the interrupted run read as a failure: sixth GPU run, second call)
    res["kernels_compiled"] = _pytest_run(check, "kernels", ["tests/kernels"], env,
                                          deadline - time.monotonic() - (CUDA_MARKED_S if files else 0), workers)
    res["kernels_compiled"]["env"] = "TRITON_INTERPRET=0 MEMOPT_FLASH_NO_AUTOTUNE=1 (compiled for the GPU, fixed tiles)"
    res["kernels_compiled"]["bf16_cuda"] = {k: v for k, v in res["kernels_compiled"]["outcomes"].items() if "bf16_cuda" in k}
    if files and deadline - time.monotonic() > 10:
        res["cuda_marked"] = _pytest_run(check, "cuda_marked", ["-m", "cuda", *files], dict(os.environ, PYTHONUNBUFFERED="1"),
                                         deadline - time.monotonic())
    elif not files:
        res["cuda_marked"] = {"note": "no test marked cuda outside tests/kernels"}
    bad = any(isinstance(v, dict) and (v.get("timed_out") or v.get("counts", {}).get("failed") or v.get("counts", {}).get("error")
                                       or v.get("rc") not in (0, 5, None)) for v in res.values())
    bf16 = res["kernels_compiled"]["bf16_cuda"]
    if not bf16 or any(v != "PASSED" for v in bf16.values()):
        bad = True
        res["_note"] = f"test_bf16_cuda did not pass on the GPU: {bf16 or 'not reached'}"
    if bad:
        res["_status"] = "partial"
    return res


# ---- FlashAttention benchmark (a subprocess: python -m memopt.gpu_check --flash-worker FILE) ------
def flash_cases() -> list[tuple[str, int, int]]:
    return [(dt, d, n) for dt, d in FLASH_GROUPS for n in FLASH_NS]


def causal_flops(b: int, h: int, n: int, d: int) -> tuple[float, float]:
    """(forward, forward+backward) FLOPs of causal attention: 2 matmuls of 2*N*N*D, half the tiles;
    the backward counts 2.5x the forward (5 matmuls against 2), FlashAttention's convention."""
    fwd = 4.0 * b * h * n * n * d * 0.5
    return fwd, 3.5 * fwd


def start_flash_warm(check: Check) -> None:
    """Compile the autotuned kernels of every (dtype, head dim) in the background (Triton's on-disk
    cache keeps them for the flash section's process)."""
    log = check.log_path("flash_warm")
    p = spawn([sys.executable, "-m", "memopt.gpu_check", "--flash-warm"], log, dict(os.environ, PYTHONUNBUFFERED="1"))
    check.background["flash_warm"] = (p, {"log": log, "t0": time.monotonic()})


def flash_warm() -> int:
    import torch

    from memopt.kernels.flash_attn import flash_attn

    for dt_name, d in FLASH_GROUPS:
        t0 = time.perf_counter()
        q, k, v = (torch.randn(1, 8, FLASH_NS[0], d, device="cuda", dtype=getattr(torch, dt_name), requires_grad=True)
                   for _ in range(3))
        flash_attn(q, k, v, causal=True).sum().backward()
        torch.cuda.synchronize()
        print(f"warm {dt_name} D={d}: {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


def section_flash(check: Check, cap: float, rec: dict) -> dict:
    if check.mode != "cuda":
        raise SkipSection("no CUDA device: the Triton kernels are compared with SDPA's flash backend on a GPU only")
    t_start = time.monotonic()
    warm = check.background.get("flash_warm")
    if warm is not None:  # let the compile finish (it saves the time it takes), not past a third of the cap
        try:
            warm[0].wait(timeout=max(1.0, cap / 3))
        except subprocess.TimeoutExpired:
            _kill_group(warm[0])
        rec["warm_s"] = round(time.monotonic() - warm[1]["t0"], 1)
    path = os.path.join(check.work, "flash.jsonl")
    if os.path.exists(path):
        os.remove(path)
    log = check.log_path("flash")
    cap = max(10.0, cap - (time.monotonic() - t_start))
    r = run_cmd([sys.executable, "-m", "memopt.gpu_check", "--flash-worker", path, "--cap", str(cap - 8)], cap, log,
                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    cases = []
    try:
        with open(path) as f:
            cases = [json.loads(line) for line in f if line.strip()]
    except OSError:
        pass
    res = {"cases": cases, "worker": r, "expected_cases": len(flash_cases()),
           "convention": "causal; fwd FLOPs 2*B*H*N*N*D (half of 4*B*H*N*N*D), fwd+bwd 3.5x fwd; times: median of "
                         f"{FLASH_REPS} after {FLASH_WARMUP} warm-ups (CUDA events), each over {FLASH_QUEUED} calls queued "
                         "back to back (*_isolated_ms: one call after an idle GPU, launch latency included); peak: max_memory_allocated during one "
                         "fwd+bwd (inputs and dO included); errors: max abs vs SDPA math backend on fp32 copies"}
    done = [c for c in cases if "memopt" in c]
    if r["rc"] != 0 or r["timed_out"] or len(done) < len(flash_cases()) or any(c.get("error") or (c.get("memopt") or {}).get("error") for c in cases):
        res["_status"] = "partial" if cases else "error"
        errors = [c.get("error") or (c.get("memopt") or {}).get("error") or (c.get("sdpa") or {}).get("error") for c in cases]
        errors = [e for e in errors if e]
        res["_note"] = (f"{len(done)} of {len(flash_cases())} cases measured; {len(errors)} with an error"
                        + (f", the first: {errors[0][:200]}" if errors else "")) if cases else tail(log, 300)
    return res


def flash_worker(path: str, cap: float, device: str = "cuda", cases=None, tokens: int = FLASH_TOKENS) -> int:
    """The flash section's cases, one JSON line each into ``path``. ``device="cpu"`` (with
    TRITON_INTERPRET=1, tiny fp32 cases) exercises the same code on a CPU for the tests."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from memopt.kernels.flash_attn import flash_attn, tuned_blocks

    end = time.monotonic() + cap
    dev = torch.device(device)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference in IEEE fp32 (the default, made sure)
    except Exception:  # noqa: BLE001  (a release that only takes fp32_precision: its default is IEEE too)
        pass

    def emit(rec):
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def sdpa_flash(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    impls = {"memopt": lambda q, k, v: flash_attn(q, k, v, causal=True), "sdpa": sdpa_flash}
    for dt_name, d, n in cases or flash_cases():
        if time.monotonic() > end - 3:
            emit({"dtype": dt_name, "head_dim": d, "n": n, "error": "not run: the section's cap was reached"})
            continue
        dtype = getattr(torch, dt_name)
        bh = max(1, tokens // n)
        h = min(8, bh)
        b = bh // h
        rec = {"dtype": dt_name, "head_dim": d, "n": n, "batch": b, "heads": h, "batch_heads": bh}
        try:
            g = torch.Generator(device=dev).manual_seed(n + d)
            q, k, v, do = (torch.randn(b, h, n, d, device=dev, dtype=dtype, generator=g) for _ in range(4))
            # fp32 reference, a few heads at a time (the math backend holds B*H*N*N fp32 scores and probs)
            ref = {key: torch.empty(b, h, n, d, device=dev, dtype=torch.float32) for key in ("out", "dq", "dk", "dv")}
            step = max(1, (1 << 30) // (n * n * 4))
            for bi in range(b):
                for h0 in range(0, h, step):
                    sl = (slice(bi, bi + 1), slice(h0, h0 + step))
                    qf, kf, vf = (t[sl].float().requires_grad_() for t in (q, k, v))
                    with sdpa_kernel(SDPBackend.MATH):
                        o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
                    o.backward(do[sl].float())
                    ref["out"][sl], ref["dq"][sl], ref["dk"][sl], ref["dv"][sl] = o.detach(), qf.grad, kf.grad, vf.grad
                    del qf, kf, vf, o
            _empty_cache(dev)
            rec["ref_max_abs"] = {key: float(t.abs().max()) for key, t in ref.items()}
            fwd_flops, fb_flops = causal_flops(b, h, n, d)
            for name, fn in impls.items():
                rec[name] = _bench_one(fn, q, k, v, do, ref, fwd_flops, fb_flops)
            rec["memopt_tiles"] = tuned_blocks()
            m, s = rec["memopt"], rec["sdpa"]
            if not m.get("error") and not s.get("error"):
                rec["memopt_err_over_sdpa_err"] = {key: (m["max_abs_err"][key] / s["max_abs_err"][key]) if s["max_abs_err"][key] else None
                                                   for key in m["max_abs_err"]}
                rec["speedup_sdpa_over_memopt_fwdbwd"] = m["fwdbwd_ms"] / s["fwdbwd_ms"] if s["fwdbwd_ms"] else None
            del ref
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {exc}"
        emit(rec)
        _empty_cache(dev)
    return 0


def _empty_cache(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _bench_one(fn, q, k, v, do, ref, fwd_flops, fb_flops) -> dict:
    import torch

    dev = q.device
    out: dict = {}
    try:
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))

        def fwdbwd():
            qq.grad = kk.grad = vv.grad = None
            o = fn(qq, kk, vv)
            o.backward(do)
            return o

        t0 = time.perf_counter()
        o = fwdbwd()
        _sync(dev)
        out["first_call_s"] = round(time.perf_counter() - t0, 3)  # compile + autotune included
        out["max_abs_err"] = {
            "out": float((o.detach().float() - ref["out"]).abs().max()),
            "dq": float((qq.grad.float() - ref["dq"]).abs().max()),
            "dk": float((kk.grad.float() - ref["dk"]).abs().max()),
            "dv": float((vv.grad.float() - ref["dv"]).abs().max()),
        }
        del o
        for _ in range(FLASH_WARMUP):
            fwdbwd()
        _sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            fwdbwd()
            torch.cuda.synchronize(dev)
            out["peak_bytes"] = torch.cuda.max_memory_allocated(dev)
            out["peak_over_start_bytes"] = out["peak_bytes"] - base

        host: dict[int, list[float]] = {}

        def timed(f, queued: bool) -> float:
            """Median of FLASH_REPS timings. Isolated: one call between two events, the GPU idle before it,
            so the host's launch latency counts. Queued: FLASH_QUEUED calls back to back between two events
            (per call), the GPU kept busy as in training, so only GPU time counts unless the host is slower
            than the GPU: the host's own time per queued call (launching, before the synchronize) is kept
            beside it (``*_host_ms``: above the queued time, the call is bound by the host)."""
            ts = []
            calls = FLASH_QUEUED if queued else 1
            for _ in range(FLASH_REPS):
                if dev.type == "cuda":
                    a, b_ = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    t_host = time.perf_counter()
                    for _ in range(calls):
                        f()
                    if queued:
                        host.setdefault(id(f), []).append(1e3 * (time.perf_counter() - t_host) / calls)
                    b_.record()
                    torch.cuda.synchronize(dev)
                    ts.append(a.elapsed_time(b_) / calls)
                else:
                    t1 = time.perf_counter()
                    for _ in range(calls):
                        f()
                    ts.append(1e3 * (time.perf_counter() - t1) / calls)
            ts.sort()
            return ts[len(ts) // 2]

        with torch.no_grad():
            for _ in range(FLASH_WARMUP):
                fn(q, k, v)
            fwd = lambda: fn(q, k, v)  # noqa: E731
            out["fwd_ms"] = timed(fwd, queued=True)
            out["fwd_isolated_ms"] = timed(fwd, queued=False)
        out["fwdbwd_ms"] = timed(fwdbwd, queued=True)
        out["fwdbwd_isolated_ms"] = timed(fwdbwd, queued=False)
        for name, f in (("fwd", fwd), ("fwdbwd", fwdbwd)):
            if host.get(id(f)):
                ms = sorted(host[id(f)])
                out[f"{name}_host_ms"] = ms[len(ms) // 2]
        out["fwd_tflops"] = fwd_flops / (out["fwd_ms"] * 1e-3) / 1e12
        out["fwdbwd_tflops"] = fb_flops / (out["fwdbwd_ms"] * 1e-3) / 1e12
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


# ---- compositions: planned vs measured -------------------------------------------------------
def train_run(check: Check, name: str, overrides: list[str], steps: int, timeout: float, extra: list[str] = ()) -> dict:
    d = os.path.join(check.work, f"run_{name}")
    shutil.rmtree(d, ignore_errors=True)
    dry = check.mode != "cuda"
    cmd = [sys.executable, "-m", "memopt.train", *composition_args(name, overrides, dry),
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
            r = train_run(check, name, ov, steps, min(left, max(share * 1.6, 20)))
            r.update(wait_plan(check, name, min(deadline, time.monotonic() + 30)))
            r["rel_err_tracker"] = _rel(r.get("planned_device_bytes"), r.get("tracker_device_bytes"))
            r["rel_err_allocator"] = _rel(r.get("planned_device_need_bytes"), r.get("allocator_peak_bytes"))
            r["rel_err_host"] = _rel(r.get("planned_host_bytes"), r.get("tracker_host_bytes"))
            r["rel_err_step_time"] = _rel(r.get("planned_step_s"), r.get("step_time_s"))
        except Exception as exc:  # noqa: BLE001
            r = {"name": name, "status": "error", "error": f"{type(exc).__name__}: {exc}"}
        runs.append(r)
        rec["result"] = {"runs": runs}
        check.write()
    res: dict = {"runs": runs, "model": DRY_MODEL if dry else MODEL, "hardware": DRY_HARDWARE if dry else HARDWARE,
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


def section_throughput(check: Check, cap: float, rec: dict) -> dict:
    comps = (((check.results["sections"].get("compositions") or {}).get("result")) or {}).get("runs") or []
    ok = [r for r in comps if r.get("status") == "ok" and r.get("tokens_per_s")]
    if not ok:
        raise SkipSection("no composition trained successfully above")
    best = max(ok, key=lambda r: r["tokens_per_s"])
    names = ["plain_bf16"] + ([best["name"]] if best["name"] != "plain_bf16" else [])
    deadline = time.monotonic() + cap
    dry = check.mode != "cuda"
    runs = []
    for i, name in enumerate(names):
        ov = dict(compositions(check))[name]
        left = deadline - time.monotonic()
        if left < 8:
            runs.append({"name": name, "status": "skipped", "error": "the section's cap was reached"})
            continue
        r = train_run(check, f"{name}_untracked", ov, DRY_TRAIN_STEPS if dry else 12, left / (len(names) - i),
                      extra=["trainer.track_memory=false"])
        r["name"] = name
        runs.append(r)
    res = {"runs": runs, "best_tracked": best["name"],
           "note": "the plain composition and the fastest one (by tracked tokens/s) rerun with trainer.track_memory=false; "
                   "MFU against the hardware profile's dense peak"}
    if any(r.get("status") != "ok" for r in runs):
        res["_status"] = "partial"
    return res


SECTION_FNS = {"env": section_env, "tests": section_tests, "flash": section_flash,
               "compositions": section_compositions, "throughput": section_throughput}


def run_check(out: str, budget_s: float = DEFAULT_BUDGET_S, mode: str = "cuda", sections=SECTIONS,
              wheels: dict | None = None, caps: dict | None = None) -> dict:
    check = Check(out, budget_s, mode)
    check.results["wheels"] = wheels

    def on_signal(signum, frame):  # a timeout from outside: stop the children, keep what was measured
        check.finish(status=f"interrupted by signal {signum}")
        os._exit(130)

    old_handlers = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            old_handlers[sig] = signal.signal(sig, on_signal)
        except ValueError:  # not the main thread
            pass
    check.results["sections_planned"] = list(sections)
    caps = {**CAPS, **(caps or {})}
    try:
        for name in sections:
            if name == "env":
                check.run_section("env", SECTION_FNS["env"], caps["env"])
                if "compositions" in sections:
                    try:
                        start_plans(check)  # the plans run on the CPU while the GPU sections run
                    except Exception as exc:  # noqa: BLE001
                        check.results["plans_start_error"] = f"{type(exc).__name__}: {exc}"
                continue
            check.run_section(name, SECTION_FNS[name], caps[name])
    finally:
        check.finish()
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
    return check.results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m memopt.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", help="folder for gpu_check.json, gpu_check.txt, gpu_check_logs.txt")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("MEMOPT_GPU_CHECK_BUDGET", DEFAULT_BUDGET_S)),
                    help="global time budget in seconds (default %(default)s)")
    ap.add_argument("--wheels", default=os.path.join(REPO, ".whl"), help="folder of wheels to install (default .whl)")
    ap.add_argument("--site", default=os.path.join(tempfile.gettempdir(), "memopt-gpu-check-site"),
                    help="pip --target folder for the wheels")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    ap.add_argument("--cpu-dry-run", action="store_true", help="run the orchestration on a CPU (tiny model; CUDA sections skipped)")
    ap.add_argument("--no-install", action="store_true", help="do not install the wheels (the packages are importable already)")
    ap.add_argument("--flash-worker", metavar="JSONL", help=argparse.SUPPRESS)
    ap.add_argument("--flash-warm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cap", type=float, default=60.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.flash_worker:
        return flash_worker(args.flash_worker, args.cap)
    if args.flash_warm:
        return flash_warm()
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not args.out:
        ap.error(f"unknown sections {unknown}" if unknown else "the output folder is required")

    if not args.cpu_dry_run:
        ok, why = detect_cuda()
        if not ok:
            print(f"gpu-check: no CUDA device here ({why}); nothing to check.")
            return 0
    mode = "cuda" if not args.cpu_dry_run else "cpu-dry-run"
    wheels = None
    if not args.no_install:
        try:
            wheels = install_wheels(args.wheels, args.site)
        except Exception as exc:  # noqa: BLE001  (recorded in env; the sections then say what is missing)
            wheels = {"error": f"{type(exc).__name__}: {exc}"}
            add_paths([REPO, args.site])
    else:
        add_paths([REPO])
    print(f"gpu-check: {mode}, budget {args.budget:.0f} s, results in {args.out}", flush=True)
    results = run_check(args.out, args.budget, mode, sections, wheels)
    print(format_text(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
