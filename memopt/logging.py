"""Run records (metrics.jsonl; summary.json is written by ``memopt.outcome``) and Weights & Biases logging.

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
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk or a vanished directory: no torn or empty file left behind
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def free_space(path: str) -> str:
    """Free bytes on the file system holding ``path`` (the nearest existing parent), for messages."""
    import shutil

    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        free = shutil.disk_usage(path or ".").free
    except OSError:
        return "unknown"
    return f"{free / 2**20:.1f} MiB"


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

    def __init__(self, run_dir: str, cfg, resolved_config: dict, run_name: str, group: str | None, tags: list[str], enabled: bool = True,
                 run_id: str | None = None):
        self.run_dir, self.run_id = run_dir, run_id
        self.enabled = enabled
        self._wandb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "metrics.jsonl")
        _drop_torn_tail(path)
        self._metrics = open(path, "a", buffering=1)
        lg = cfg.logger
        tags = sorted(set(tags) | set(run_tags(cfg)))
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
        if self.run_id is not None:
            record = {"run_id": self.run_id, **record}  # a resumed run's records are told apart by it
        try:
            self._metrics.write(json.dumps(_jsonable(record)) + "\n")
        except OSError as e:
            from memopt.errors import WriteError

            path = os.path.join(self.run_dir, "metrics.jsonl")
            raise WriteError(f"the metrics could not be written to {path}: {e.strerror or e} ({free_space(self.run_dir)} "
                             f"free there) at step {record.get('step')}; the checkpoints written so far are intact: free "
                             "space and continue with trainer.resume=auto") from None
        if self._wandb is not None:
            self._wandb.log(flat_metrics(record), step=record["step"])

    def finish(self, summary: dict) -> None:
        """Close the metrics and W&B (the caller has recorded ``summary`` through ``outcome.record``)."""
        if not self.enabled:
            return
        self._metrics.close()
        if self._wandb is not None:
            self._log_peak_table(summary)
            for k, v in _flatten(summary).items():
                self._wandb.summary[k] = v
            run_dir = self._wandb.dir
            self._wandb.finish(exit_code=0 if summary.get("status") == "ok" else 1)
            if self.wandb_mode == "offline":
                off = os.path.dirname(os.path.normpath(run_dir))
                print(f"W&B ran offline; to upload: wandb sync {off}", file=sys.stderr)

    def _log_peak_table(self, summary: dict) -> None:
        """Peak bytes by rank, device and category as a W&B Table (``peak_bytes_table``, which the
        report's table panel shows) and a bar chart of rank 0's categories (``peak_bytes_chart``).
        A failure here costs the table, never the run's summary."""
        peaks = summary.get("peak_bytes") or {}
        if not peaks:
            return
        try:
            import wandb

            rows = [[str(rank), dev, cat, int(b), b / 2**20] for rank, devs in peaks.items() for dev, cats in devs.items()
                    for cat, b in cats.items() if isinstance(b, (int, float))]
            table = wandb.Table(columns=["rank", "device", "category", "bytes", "MiB"], data=rows)
            first = sorted(peaks)[0]
            bars = wandb.Table(columns=["category", "MiB"], data=[[f"{dev}/{cat}", mib] for rank, dev, cat, _, mib in rows
                                                                  if rank == first and cat != "total"])
            chart = wandb.plot.bar(bars, "category", "MiB", title=f"peak MiB by category (rank {first})")
            self._wandb.log({"peak_bytes_table": table, "peak_bytes_chart": chart})
        except Exception as e:  # noqa: BLE001
            print(f"memopt: could not log the peak-bytes table to W&B ({type(e).__name__}: {e})", file=sys.stderr)


def run_tags(cfg) -> list[str]:
    """Tags every run gets besides its strategies and engine: the model and the world size."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
    except ImportError:
        pass
    return [str(cfg.model.name), f"world_size={world}"]


def _drop_torn_tail(path: str) -> None:
    """Cut a last line without its newline (a run killed while writing it): a resumed run's first record had been
    appended to it, and neither line read as JSON."""
    try:
        with open(path, "rb+") as f:
            end = f.seek(0, os.SEEK_END)
            start = max(0, end - (1 << 20))  # a record is far shorter than 1 MiB
            f.seek(start)
            tail = f.read()
            cut = tail.rfind(b"\n")
            if end and not tail.endswith(b"\n") and (cut >= 0 or start == 0):
                f.truncate(start + cut + 1)  # (cut = -1 at start 0: the only line is torn)
    except FileNotFoundError:
        pass


def flat_metrics(record: dict) -> dict:
    """A metrics.jsonl record as W&B scalars: nested dicts (peak/live bytes per device, the chunk
    engine's ``chunk`` placement, MoE statistics) become ``key/subkey``; non-numbers are dropped."""
    out = {}
    for k, v in _flatten({k: v for k, v in record.items() if k != "step"}, lists=False).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v
        elif isinstance(v, bool):
            out[k] = int(v)
    return out


def _flatten(d: dict, prefix: str = "", lists: bool = True) -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/", lists))
        elif isinstance(v, (list, tuple)):
            if lists:
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
