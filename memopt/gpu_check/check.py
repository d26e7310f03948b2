"""The orchestration's state: sections in order, each capped, the whole within a global budget; the results
written after each, the background processes stopped at the end."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

from memopt.gpu_check.procs import kill_all, kill_group, tail
from memopt.gpu_check.results import new_results, utc_now, write_results, write_text_atomic
from memopt.gpu_check.settings import DEFAULT_BUDGET_S, MIN_SECTION_S, RESERVE_S


class SkipSection(Exception):
    """A section that cannot run here; its message is the stated reason."""


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
                kill_group(p)
        kill_all()
        self.results["status"] = status
        self.results["finished"] = utc_now()
        self.write()
        self.write_logs()
        return self.results

    def write_logs(self) -> None:
        parts = []
        for path in self.logs:
            parts.append(f"===== {os.path.basename(path)} (last 6000 characters) =====\n{tail(path, 6000)}\n")
        try:
            write_text_atomic(os.path.join(self.out, "gpu_check_logs.txt"), "".join(parts))
        except OSError:
            pass
