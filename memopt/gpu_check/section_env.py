"""The env section: GPU, driver and library versions, the wheel install, and whether memopt (and DeepSpeed)
import in a fresh interpreter, which is what every later subprocess sees."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from memopt.gpu_check.check import Check
from memopt.gpu_check.procs import run_cmd, tail
from memopt.gpu_check.settings import REPO


def memory_bandwidth(device, nbytes: int = 1 << 30, reps: int = 10) -> dict:
    """The device memory's rate for an elementwise op (``c = a + b`` in bf16: two tensors read, one written;
    GB/s of bytes read + written, the median of ``reps``), which the planner's ``hardware.memory_gbps`` means.
    Why: the GPU profiles price memory-bound ops inside ``compute_efficiency``; a measured rate lets the next
    profile split the step into products and memory-bound ops (experiments/planner/README.md, seventh run)."""
    import time

    import torch

    n = max(1, nbytes // 2)
    a, b = (torch.ones(n, dtype=torch.bfloat16, device=device) for _ in range(2))
    c = torch.empty_like(a)
    moved = 3 * n * a.element_size()
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    torch.add(a, b, out=c)
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.add(a, b, out=c)
        sync()
        times.append(time.perf_counter() - t0)
    med = sorted(times)[len(times) // 2]
    return {"op": "bf16 add, out=", "bytes_per_op": moved, "seconds": med, "gbps": moved / med / 1e9}


def _bandwidth_in_a_subprocess(check: Check, timeout: float) -> dict:
    log = check.log_path("env_bandwidth")
    code = ("import json; from memopt.gpu_check.section_env import memory_bandwidth; "
            "print(json.dumps(memory_bandwidth('cuda')))")
    r = run_cmd([sys.executable, "-c", code], timeout, log)
    last = (tail(log, 2000).strip().splitlines() or [""])[-1]
    if r["rc"] == 0:
        try:
            return json.loads(last)
        except ValueError:
            pass
    return {"error": f"rc {r['rc']}: {last[:300]}"}


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
    if info.get("cuda_available"):  # in a process of its own: this one keeps no CUDA memory beside the timed runs
        info["memory_bandwidth"] = _bandwidth_in_a_subprocess(check, min(cap, 60))
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
