"""``python3 -m memopt.gpu_check OUT``: the arguments, the no-CUDA exit, the wheel install and the sections
in order (``run_check``)."""
from __future__ import annotations

import argparse
import os
import signal
import tempfile

import memopt.gpu_check as _pkg
from memopt.gpu_check.check import Check
from memopt.gpu_check.flash import flash_warm, flash_worker, section_flash
from memopt.gpu_check.procs import add_paths, detect_cuda, install_wheels
from memopt.gpu_check.results import format_text
from memopt.gpu_check.runs import section_compositions, section_throughput, start_plans
from memopt.gpu_check.section_env import section_env
from memopt.gpu_check.section_tests import section_tests
from memopt.gpu_check.settings import CAPS, DEFAULT_BUDGET_S, REPO, SECTIONS


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
    ap = argparse.ArgumentParser(prog="python3 -m memopt.gpu_check", description=_pkg.__doc__.split("\n\n")[0])
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
