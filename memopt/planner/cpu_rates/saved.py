"""``hardware.rates_file``: this CPU's measured step-time rates kept in a file, so that plans made in separate
processes (each engine's ``+strategy=auto``, plan mode's commands) rank by one reading of the machine.

Why: each process measures the rates anew (``cpu_rates.measured``), and a shared CPU's rates move by a few
percent between minutes. Two searches that plan their choices 0.3% apart in two processes order them by when
each probed (moe_small at 100% on the AMD EPYC, 2026-11-29: Spearman -1.00 over the two engines' choices, 1.00
when the same rows were planned in one process; with one reading the choices still planned 0.1% apart there, which
no plan orders). The first plan that names the file measures and writes it; every later one with the same key
reads it and runs none of the probes (the matmul peaks and the copy rate a run reads anyway, 0.4 s, are read and
then replaced by the file's). A lock beside the file (``<file>.lock``) makes a plan that starts while another
measures wait for its reading. The key is what the readings depend on: the format of the entries, the machine (its
host name, CPU model and flags), torch, the intra-op threads, the block the probes time (``probe_shape``), whether
freed CPU blocks are kept (``trainer.cpu_malloc_cache``) and the rates the profile gives itself; another key
measures and is added.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
import tempfile
import warnings
from dataclasses import fields, replace

import torch

from memopt.errors import ConfigError

FORMAT = 1  # raised when FIELDS or what a probe measures changes: older entries are then measured again
# what resolve_hardware and cpu_rates.complete fill in for this CPU and the plan's step time reads
FIELDS = ("peak_tflops", "host_device_gbps", "device_device_gbps", "ranks_share_device", "compute_efficiency",
          "dtype_efficiency", "attention_efficiency", "memory_gbps", "dtype_memory_gbps", "activation_gbps",
          "op_overhead_us", "dtensor_op_overhead_us", "collective_latency_us", "collective_latency_us_by_kind",
          "collective_gbps_by_kind", "host_adam_gparams_s")


def given(profile) -> dict:
    """The step-time fields ``profile`` sets itself (not its dataclass default): they win over any reading."""
    defaults = {f.name: (f.default_factory() if callable(f.default_factory) else f.default)
                for f in fields(profile) if f.name in FIELDS}
    return {name: getattr(profile, name) for name in FIELDS if getattr(profile, name) != defaults[name]}


def key(profile, shape: tuple[int, ...], malloc_cache: bool) -> str:
    """The file's entry for readings taken here, for ``profile`` and the probes' block ``shape``."""
    from memopt.memory.hardware import cpuinfo_field

    flags = cpuinfo_field("flags", "Features") or ""  # one model name covers CPUs whose bf16 differs 10x
    return json.dumps({"format": FORMAT, "machine": platform.node(),
                       "cpu": cpuinfo_field("model name") or platform.processor() or platform.machine(),
                       "cpu_flags": hashlib.sha1(flags.encode()).hexdigest()[:12], "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "shape": list(shape), "cpu_malloc_cache": bool(malloc_cache),
                       "given": given(profile)}, sort_keys=True)


def _read(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            entries = json.load(f)
        if not isinstance(entries, dict):
            raise ValueError("not a JSON object")
        return entries
    except (OSError, ValueError) as e:
        raise ConfigError(f"hardware.rates_file={path}: cannot be read as measured rates ({type(e).__name__}: {e}); "
                          "remove the file or name a new path, and the next plan measures and writes it") from None


def check(path: str | None) -> None:
    """Refuse a rates file that cannot be read, or written where it does not exist yet, before anything is measured
    (at validation: a file of a few entries, parsed in microseconds)."""
    if path is None:
        return
    _read(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"hardware.rates_file={path}: its folder {folder} does not exist; name a path in an "
                          "existing folder (the first plan writes the file there)")


def load(path: str, entry: str, hw):
    """``hw`` with the readings of ``entry`` from ``path``, or None where the file has no complete such entry."""
    from memopt.memory.hardware import check_hardware

    saved = _read(path).get(entry)
    if not isinstance(saved, dict) or set(saved) != set(FIELDS):
        return None
    kept = replace(hw, **saved)
    try:
        check_hardware(kept)
    except ConfigError as e:
        raise ConfigError(f"hardware.rates_file={path}: an entry holds a rate the plan cannot use ({e}); remove the "
                          "file or name a new path, and the next plan measures and writes it") from None
    return kept


def save(path: str, entry: str, hw) -> None:
    """Add ``hw``'s readings to ``path`` under ``entry``: written whole to a temporary file in its folder, then moved
    over it (a reader never sees half a file). A file that cannot be written costs its readings, not the plan."""
    try:
        entries = _read(path)
        entries[entry] = {name: getattr(hw, name) for name in FIELDS}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".rates-")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        warnings.warn(f"memopt planner: hardware.rates_file={path} could not be written ({e}); this plan goes on with "
                      "the rates it measured", stacklevel=2)


@contextlib.contextmanager
def _locked(path: str):
    """Hold ``<path>.lock`` exclusively (POSIX ``flock``): a second process waits until the first has written."""
    try:
        import fcntl

        f = open(f"{path}.lock", "a")
    except (ImportError, OSError):  # no flock here, or a folder we cannot write: each process measures its own
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def reading(path: str, entry: str, hw, measure):
    """``hw`` with the reading ``path`` holds for ``entry``, or with ``measure(hw)``'s, which is then written there.
    One process at a time measures for a file: one that starts meanwhile waits and reads."""
    with _locked(path):
        kept = load(path, entry, hw)
        if kept is not None:
            print(f"memopt planner: this CPU's step-time rates read from hardware.rates_file={path}", file=sys.stderr,
                  flush=True)
            return kept
        measured = measure(hw)
        save(path, entry, measured)
        return measured
