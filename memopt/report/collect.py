"""Read run directories into ``Run`` records: summary.json, metrics.jsonl and Hydra's ``.hydra/`` files.

A job that was refused, or a 2-rank job that failed before rank 0 built its trainer, writes a
summary.json without ``engine`` / ``strategy``. The job's own ``.hydra/config.yaml`` (what it was
asked to run) fills those in, then ``.hydra/overrides.yaml``, so a failed row never reads "plain"
on the wrong engine.
"""
from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field

import yaml

CATEGORIES = ("params", "grads", "optim", "activations", "temp", "chunks", "comm", "other")
HOST = "host"


@dataclass
class Run:
    job: str  # path relative to the directory it was found under (the sweep's job number)
    path: str
    status: str
    engine: str | None
    strategy: list[str]
    model: str | None
    world_size: int | None
    overrides: list[str]
    summary: dict
    config: dict
    metrics: list[dict] = field(default_factory=list)
    label: str = ""
    wandb_id: str | None = None  # known when the run was read from W&B (else found in its wandb/ dir)
    group: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def strategy_name(self) -> str:
        return "+".join(self.strategy) or "plain"

    def get(self, key: str):
        v = self.summary.get(key)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    @property
    def devices(self) -> list[str]:
        """Compute-device keys seen in the peaks (``cpu``, ``cuda:0``, ...), host excluded."""
        out: list[str] = []
        for devs in self._ranks():
            out += [d for d in devs if d != HOST and d not in out]
        return out

    def _ranks(self) -> list[dict]:
        """Per-rank ``{device: {category: bytes}}`` (a W&B summary also holds the per-step
        ``peak_bytes/<device>`` scalars under the same key: those are not ranks)."""
        peaks = self.summary.get("peak_bytes") or {}
        return [devs for devs in peaks.values() if isinstance(devs, dict)]

    def peaks(self, side: str) -> dict[str, int]:
        """Per-category peak bytes (the maximum over ranks) on the compute device(s) or the host."""
        out: dict[str, int] = {}
        for devs in self._ranks():
            for dev, cats in devs.items():
                if (dev == HOST) != (side == HOST) or not isinstance(cats, dict):
                    continue
                for c, b in cats.items():
                    if isinstance(b, (int, float)):
                        out[c] = max(out.get(c, 0), int(b))
        return out

    def overrides_dict(self) -> dict[str, str]:
        return parse_overrides(self.overrides)


def parse_overrides(overrides: list[str]) -> dict[str, str]:
    """``["+strategy=zero2", "engine=deepspeed"]`` -> ``{"strategy": "zero2", "engine": "deepspeed"}``
    (Hydra's ``+``/``++``/``~`` prefixes dropped; ``hydra.*`` settings are not what a job changed)."""
    out = {}
    for o in overrides:
        key, _, value = str(o).partition("=")
        key = key.lstrip("+~")
        if key and not key.startswith("hydra."):
            out[key] = value
    return out


def _load_yaml(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return yaml.safe_load(f)


def _load_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def read_metrics(path: str) -> list[dict]:
    """metrics.jsonl; a torn last line (a job killed mid-write) is skipped."""
    out = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return out


def _strategies_from_overrides(overrides: dict[str, str]) -> list[str]:
    v = overrides.get("strategy", "")
    return [s.strip() for s in v.strip("[]").split(",") if s.strip()]


def read_run(path: str, job: str) -> Run:
    file = os.path.join(path, "summary.json")
    try:
        s = _load_json(file)
    except (ValueError, UnicodeDecodeError) as e:  # a torn or damaged record: that row says so, the report goes on
        print(f"memopt.report: {file} is not readable JSON ({e}); its run is listed as 'unreadable summary'",
              file=sys.stderr)
        s = {"status": "unreadable summary", "error": f"{file}: {e}"}
    cfg = _load_yaml(os.path.join(path, ".hydra", "config.yaml")) or {}
    overrides = _load_yaml(os.path.join(path, ".hydra", "overrides.yaml")) or []
    ov = parse_overrides(overrides)
    engine = s.get("engine") or (cfg.get("engine") or {}).get("name") or ov.get("engine")
    if "strategy" in s:
        strategy = list(s["strategy"] or [])
    elif isinstance(cfg.get("strategy"), dict):  # the schema lists every strategy; selected ones are set
        strategy = [k for k, v in cfg["strategy"].items() if v is not None]
    else:
        strategy = _strategies_from_overrides(ov)
    world = s.get("world_size")
    if world is None and isinstance(cfg.get("trainer"), dict):
        world = cfg["trainer"].get("nproc_per_node")
    return Run(job=job, path=path, status=s.get("status") or "no summary", engine=engine, strategy=strategy,
               model=s.get("model") or (cfg.get("model") or {}).get("name"), world_size=world,
               overrides=[str(o) for o in overrides], summary=s, config=cfg,
               metrics=read_metrics(os.path.join(path, "metrics.jsonl")))


def _is_run_dir(path: str) -> bool:
    return os.path.exists(os.path.join(path, "summary.json")) or os.path.exists(os.path.join(path, ".hydra", "config.yaml"))


def _natural(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def find_run_dirs(root: str) -> list[str]:
    """``root`` itself when it is a run directory, else every run directory below it (a sweep)."""
    if _is_run_dir(root):
        return [root]
    found = []
    for dirpath, dirnames, _ in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("wandb", "figures", ".submitit", ".hydra", ".memopt")]
        if dirpath != root and _is_run_dir(dirpath):
            found.append(dirpath)
            dirnames[:] = []
    return sorted(found, key=lambda p: _natural(os.path.relpath(p, root)))


def collect_runs(dirs: list[str]) -> list[Run]:
    """Every run under ``dirs`` (sweep directories or run directories), labelled (see ``label_runs``)."""
    runs = []
    for d in dirs:
        if not os.path.isdir(d):
            raise FileNotFoundError(f"{d} is not a directory; give a Hydra sweep directory or run directories")
        for p in find_run_dirs(d):
            job = os.path.relpath(p, d) if p != d else os.path.basename(os.path.normpath(d))
            if len(dirs) > 1 and p != d:
                job = os.path.join(os.path.basename(os.path.normpath(d)), job)
            runs.append(read_run(p, job))
    label_runs(runs)
    return runs


def label_runs(runs: list[Run]) -> None:
    """Label each run by the overrides whose values differ between the runs (in first-seen order);
    runs that differ in nothing get their job name."""
    dicts = [r.overrides_dict() for r in runs]
    keys: list[str] = []
    for d in dicts:
        keys += [k for k in d if k not in keys]
    varying = [k for k in keys if len({d.get(k) for d in dicts}) > 1]
    for r, d in zip(runs, dicts):
        r.label = " ".join(f"{k}={d[k]}" for k in varying if k in d) or r.job
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.label] = seen.get(r.label, 0) + 1
    for r in runs:
        if seen[r.label] > 1:
            r.label = f"{r.label} [{r.job}]"


def varying_keys(runs: list[Run]) -> dict[str, dict[str, str]]:
    """Per run (by job), the overrides that differ between the runs: what its label shows."""
    dicts = {r.job: r.overrides_dict() for r in runs}
    keys = {k for d in dicts.values() for k in d}
    varying = {k for k in keys if len({d.get(k) for d in dicts.values()}) > 1}
    return {job: {k: v for k, v in d.items() if k in varying} for job, d in dicts.items()}
