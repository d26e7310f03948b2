"""``hardware.rates_file``: this CPU's measured step-time rates kept in a file, so that plans made in separate
processes (each engine's ``+strategy=auto``, plan mode's commands) rank by one reading of the machine.

Why: each process measures the rates anew (``cpu_rates.measured``), and a shared CPU's rates move by a few
percent between minutes. Two searches that plan their choices 0.3% apart in two processes order them by when
each probed (moe_small at 100% on the AMD EPYC, 2026-11-29: Spearman -1.00 over the two engines' choices, 1.00
when the same rows were planned in one process; with one reading the choices still planned 0.1% apart there, which
no plan orders). The first plan that names the file measures and writes it;
every later one with the same key reads it and measures nothing. The key is what the readings depend on: the
machine, torch, the intra-op threads, the block the probes time (``probe_shape``), whether freed CPU blocks are
kept (``trainer.cpu_malloc_cache``) and the rates the profile gives itself; another key measures and is added.
"""
from __future__ import annotations

import json
import os
import platform
from dataclasses import fields, replace

import torch

from memopt.errors import ConfigError

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
    return json.dumps({"machine": platform.node(), "cpu": platform.processor() or platform.machine(),
                       "torch": torch.__version__, "threads": torch.get_num_threads(), "shape": list(shape),
                       "cpu_malloc_cache": bool(malloc_cache), "given": given(profile)}, sort_keys=True)


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
    """Refuse a rates file that cannot be read, or written where it does not exist yet, before anything is measured."""
    if path is None:
        return
    _read(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"hardware.rates_file={path}: its folder {folder} does not exist; name a path in an "
                          "existing folder (the first plan writes the file there)")


def load(path: str, entry: str, hw):
    """``hw`` with the readings of ``entry`` from ``path``, or None where the file has no such entry."""
    saved = _read(path).get(entry)
    if saved is None:
        return None
    return replace(hw, **{name: value for name, value in saved.items() if name in FIELDS})


def save(path: str, entry: str, hw) -> None:
    """Add ``hw``'s readings to ``path`` under ``entry`` (written whole to a temporary file, then moved over it:
    a reader never sees half a file)."""
    entries = _read(path)
    entries[entry] = {name: getattr(hw, name) for name in FIELDS}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(entries, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
