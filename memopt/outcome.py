"""How a job ended, recorded and said: its ``summary.json`` and the process's exit code.

Every ``summary.json`` is written by ``record``, whatever ended the job: a refusal at the gate or
before Hydra composes, plan mode's result, what the launcher adds to its ranks' record when they fail,
and the trainer's own record of the run (ok, a stop, a failure, a stalled rank). ``end`` is the one
place a job's status becomes the exit code (``errors.EXIT_CODES``; ``errors.status_of`` maps an
exception to a status): a multirun's job returns its record instead, so the sweep goes on.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

from memopt.errors import EXIT_CODES
from memopt.logging import free_space, write_json

SUMMARY = "summary.json"


def record(run_dir: str, summary: dict) -> bool:
    """The one writer of a job's ``summary.json`` (atomic): True when written; when the directory cannot
    take it (a full disk, a read-only or vanished directory) the status still reaches the user, on stderr
    with the reason, and False."""
    path = os.path.join(run_dir, SUMMARY)
    try:
        os.makedirs(run_dir, exist_ok=True)
        write_json(path, summary)
        return True
    except OSError as e:
        print(f"memopt: summary.json could not be written to {path}: {e.strerror or e} "
              f"({free_space(run_dir)} free there); the run ended with status {summary.get('status')}", file=sys.stderr)
        return False


def read(run_dir: str) -> dict | None:
    """The job's ``summary.json`` (None when there is none or it is not a JSON object)."""
    try:
        with open(os.path.join(run_dir, SUMMARY)) as f:
            out = json.load(f)
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def refusal(run_dir: str, cfg, error: str, **extra) -> dict:
    """Record a job refused before it ran (the report names what was refused through the job's identity)."""
    from memopt.sweep import job_identity

    refused = {"status": "refused", "error": error, **extra, **job_identity(cfg)}
    record(run_dir, refused)
    return refused


RANK_STOP = "stop.rank{}.json"


def record_rank_stop(run_dir: str, rank: int, status: str, error: str) -> None:
    """A rank other than 0 that stops with an outcome of its own (its device budget crossed, a divergence)
    leaves it here for the launcher: rank 0 only sees the collective its peer left (a closed connection)
    and would record ``failed``. Best effort: the launcher then says what rank 0 recorded."""
    try:
        write_json(os.path.join(run_dir, RANK_STOP.format(rank)), {"status": status, "error": error})
    except OSError:
        pass


def rank_stops(run_dir: str, world: int) -> dict[int, dict]:
    """The outcomes ranks 1..world-1 left with ``record_rank_stop``, by rank."""
    out = {}
    for r in range(1, world):
        try:
            with open(os.path.join(run_dir, RANK_STOP.format(r))) as f:
                got = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(got, dict) and got.get("status") in EXIT_CODES and got["status"] not in ("ok", "failed"):
            out[r] = got
    return out


def clear_rank_stops(run_dir: str, world: int) -> None:
    for r in range(1, world):
        try:
            os.remove(os.path.join(run_dir, RANK_STOP.format(r)))
        except OSError:
            pass


def recorded_status(run_dir: str) -> str:
    """The status a failed run wrote into its summary.json (``failed`` when it wrote none)."""
    status = (read(run_dir) or {}).get("status")
    return status if status in EXIT_CODES and status != "ok" else "failed"


@contextlib.contextmanager
def stops_raise():
    """SIGTERM and SIGINT raise ``StopRequest`` in this process while the block runs (the gate: planning before any
    rank starts), so the command records how it ended: SIGTERM's default action had killed it (exit 143, no
    summary.json, the search's worker processes left behind), SIGINT's a traceback. The previous handlers come back."""
    import signal
    import threading

    from memopt.errors import StopRequest

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise StopRequest(f"{signal.Signals(signum).name} received while planning, before any rank started")

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def end(summary: dict, multirun: bool) -> dict:
    """The job's result: its record in a multirun (the sweep goes on), else the exit code of its status. An
    interrupted job ends a multirun too (exit 130, no later job started): a stop request (a scheduler's SIGTERM,
    Ctrl-C) is for the whole command, which had run every remaining job to the end and exited 0."""
    code = EXIT_CODES.get(summary.get("status"), EXIT_CODES["failed"])
    if code and (not multirun or summary.get("status") == "interrupted"):
        if multirun:
            print("memopt: sweep stopped: a job was interrupted; the jobs after it were not started", file=sys.stderr)
        raise SystemExit(code)
    return summary


def _fmt_bytes(n: int | None) -> str:
    if not n:
        return "0"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def summary_table(summary: dict) -> str:
    """A short human-readable table of a run's summary.json."""
    def num(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    rows = [
        ("status", summary.get("status")),
        ("strategy", "+".join(summary.get("strategy") or ["plain"]) + f" ({summary.get('engine')})"),
        ("model / params", f"{summary.get('model')} / {summary.get('params', 0) / 1e6:.2f}M"),
        ("final loss / val loss", f"{num(summary.get('final_loss'), '.4f')} / {num(summary.get('val_loss'), '.4f')}"),
        ("tokens/s (median)", num(summary.get("tokens_per_s"), ",.0f")),
        ("TFLOP/s / MFU", f"{num(summary.get('tflops'), '.4f')} / {num(summary.get('mfu'), '.1%')}"),
    ]
    for rank, devs in (summary.get("peak_bytes") or {}).items():
        for dev, cats in devs.items():
            parts = ", ".join(f"{c} {_fmt_bytes(b)}" for c, b in cats.items() if c != "total" and b)
            rows.append((f"peak rank {rank} {dev}", f"{_fmt_bytes(cats.get('total'))} ({parts})"))
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)
