"""The env section: GPU, driver and library versions, the wheel install, and whether memopt (and DeepSpeed)
import in a fresh interpreter, which is what every later subprocess sees."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from memopt.gpu_check.check import Check
from memopt.gpu_check.procs import run_cmd, tail
from memopt.gpu_check.settings import REPO


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
