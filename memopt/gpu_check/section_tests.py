"""The tests section: the kernel tests compiled for the GPU and the tests marked ``cuda``, each run's outcomes
parsed from pytest's verbose output (partial output too: a run cut at its cap still counts what it ran)."""
from __future__ import annotations

import glob
import os
import re
import sys
import time

from memopt.gpu_check.check import Check, SkipSection
from memopt.gpu_check.flash import start_flash_warm
from memopt.gpu_check.procs import run_cmd, tail
from memopt.gpu_check.settings import CUDA_MARKED_S, REPO


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
    # 4 workers on 16 host cores ran 97% of the kernel tests in their 95 s (seventh check): Triton's compiles
    # are the time, and the GPU machine's cores are idle beside them
    workers = max(1, min(8, (os.cpu_count() or 1) // 2))
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
