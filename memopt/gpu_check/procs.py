"""The check's environment and subprocesses: CUDA detection, the offline wheel install, and commands run in a
process group of their own, killed whole at their cap (a hung run loses its section, not the check)."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

from memopt.gpu_check.settings import REPO


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


def add_paths(paths: list[str]) -> None:
    """Prepend ``paths`` to this process's ``sys.path`` and to ``PYTHONPATH`` (subprocesses)."""
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in paths]
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *old])


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
        kill_group(p)
        rc = p.wait()
    _LIVE.discard(p)
    return {"rc": rc, "timed_out": timed_out, "seconds": round(time.monotonic() - t0, 2)}


def kill_all() -> None:
    for p in list(_LIVE):
        if p.poll() is None:
            kill_group(p)
        _LIVE.discard(p)


def kill_group(p: subprocess.Popen) -> None:
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
