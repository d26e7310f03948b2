"""Run records (metrics.jsonl, summary.json) and Weights & Biases logging.

Rank 0 writes the records into the Hydra run directory; every rank's peaks reach it through the
trainer. W&B runs online when credentials exist and offline otherwise (the run directory then
holds ``wandb/offline-run-*`` and the message says how to sync it). ``read_wandb_offline`` reads
such a run back, which the tests use to check what was logged.
"""
from __future__ import annotations

import glob
import json
import math
import os
import struct
import sys
from typing import Any


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``path`` so that readers see the old file or the complete new one, never a torn one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write_json(path: str, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(_jsonable(obj), indent=2, sort_keys=True) + "\n").encode())


def wandb_mode(requested: str) -> str:
    """auto -> online when an API key is configured (env or netrc), else offline."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = os.path.expanduser("~/.netrc")
    if os.path.exists(netrc):
        with open(netrc) as f:
            if "api.wandb.ai" in f.read():
                return "online"
    return "offline"


class RunLogger:
    """metrics.jsonl + W&B for one run (a no-op on ranks other than 0)."""

    def __init__(self, run_dir: str, cfg, resolved_config: dict, run_name: str, group: str | None, tags: list[str], enabled: bool = True):
        self.run_dir = run_dir
        self.enabled = enabled
        self._wandb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._metrics = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)
        lg = cfg.logger
        if lg.name == "wandb":
            mode = wandb_mode(lg.mode)
            if mode != "disabled":
                os.environ.setdefault("WANDB_SILENT", "true")
                import wandb

                self._wandb = wandb.init(
                    project=lg.project, entity=lg.entity, group=group, tags=tags, name=run_name,
                    config=resolved_config, dir=run_dir, mode=mode, reinit="finish_previous",
                )
                self.wandb_mode = mode

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self._metrics.write(json.dumps(_jsonable(record)) + "\n")
        if self._wandb is not None:
            flat = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            for dev, b in record.get("peak_bytes", {}).items():
                flat[f"peak_bytes/{dev}"] = b
            self._wandb.log(flat, step=record["step"])

    def finish(self, summary: dict) -> None:
        if not self.enabled:
            return
        write_json(os.path.join(self.run_dir, "summary.json"), summary)
        self._metrics.close()
        if self._wandb is not None:
            for k, v in _flatten(summary).items():
                self._wandb.summary[k] = v
            run_dir = self._wandb.dir
            self._wandb.finish(exit_code=0 if summary.get("status") == "ok" else 1)
            if self.wandb_mode == "offline":
                off = os.path.dirname(os.path.normpath(run_dir))
                print(f"W&B ran offline; to upload: wandb sync {off}", file=sys.stderr)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        elif isinstance(v, (list, tuple)):
            out[key] = ",".join(map(str, v))
        elif v is not None:
            out[key] = v
    return out


# ---- reading an offline W&B run back --------------------------------------------------------
_BLOCK = 32768
_HEADER = 7  # ":W&B" magic, 2-byte identifier, 1-byte version


def _wandb_records(path: str):
    """Payloads of a .wandb file (a LevelDB-style log of 32 KiB blocks, 7-byte record headers)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log")
    pos, pending = _HEADER, b""
    while pos + 7 <= len(data):
        left = _BLOCK - (pos % _BLOCK)
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        if kind == 1:
            yield payload
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            yield pending + payload
            pending = b""


def read_wandb_offline(run_dir: str) -> dict:
    """{'config': {...}, 'history': [{...}], 'summary': {...}, 'group': str, 'tags': [...]} of the
    offline W&B run stored under ``run_dir``."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb")))
    if not files:
        raise FileNotFoundError(f"no offline W&B run under {run_dir}/wandb")
    out: dict = {"config": {}, "history": [], "summary": {}, "group": None, "tags": []}
    for payload in _wandb_records(files[-1]):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["group"], out["tags"] = rec.run.run_group, list(rec.run.tags)
            for item in rec.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {}
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            out["history"].append(row)
        elif kind == "summary":
            for item in rec.summary.update:
                key = item.key or "/".join(item.nested_key)
                out["summary"][key] = json.loads(item.value_json)
    return out
