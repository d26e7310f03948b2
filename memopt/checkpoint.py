"""Resumable checkpoints: ``<run dir>/checkpoints/step_<n>`` (n = optimizer steps done), written with
``torch.distributed.checkpoint`` (DCP) so that each rank writes its own files.

A checkpoint holds three parts (nested keys of one DCP state dict):
- ``model``: the weights by parameter name in fp32 (``Engine.checkpoint_model``); replicated
  tensors are spread over the ranks by DCP's save planner, sharded ones (FSDP2's DTensors) are
  written by their owners. ``merge`` turns this part into one ``model.pt``.
- ``engine``: each engine's exact training state (``Engine.checkpoint_state``): optimizer
  states wherever they live (device, host, chunks), fp32 masters, step counters, the loss scaler.
  Rank-local entries carry ``rank<r>`` in their key, so each rank reads back what it wrote.
- ``trainer``: per rank, the RNG states (CPU, CUDA when present). The step (hence the learning rate
  and the data position, which are functions of the step) is in ``meta.json``.

A checkpoint is written into ``checkpoints/.tmp-step_<n>`` and renamed when every rank has
finished, so a kill at any moment leaves the previous checkpoints intact (a leftover ``.tmp-*`` is
ignored and removed by the next save). The last ``trainer.keep_checkpoints`` are kept.
Resuming needs the same world size, engine, strategies and model (checked against ``meta.json``).

``python -m memopt.checkpoint merge <checkpoint dir> <out.pt>`` writes the weights as one file
that ``memopt.load_model`` reads.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import warnings

import torch

from memopt.errors import ConfigError, WriteError
from memopt.guards import all_finite

META = "meta.json"
FAULT_ENV = "MEMOPT_FAULT_SAVE"  # "<step>" or "<step>:<rank>": SIGKILL inside that save (tests)
FAULT_ENOSPC_ENV = "MEMOPT_FAULT_SAVE_ENOSPC"  # "<step>:<rank>": that rank's files of that save fail as on a full disk (tests)


def root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def complete(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint under the run directory, in the order they were
    written (their meta.json's time), not by step: after a run resumed from an older checkpoint in the
    same directory, its new steps are newer than the abandoned attempt's higher ones, so
    ``resume=auto`` continues it and ``keep_checkpoints`` removes the abandoned ones first."""
    base = root(run_dir)
    out = []
    if os.path.isdir(base):
        for name in os.listdir(base):
            path = os.path.join(base, name)
            if name.startswith("step_") and name[5:].isdigit() and os.path.isfile(os.path.join(path, META)):
                out.append((os.path.getmtime(os.path.join(path, META)), int(name[5:]), path))
    return [(step, path) for _, step, path in sorted(out)]


def resolve(resume: str | None, run_dir: str, field: str = "trainer.resume") -> str | None:
    """The checkpoint directory ``trainer.resume`` names: ``auto`` -> this run directory's newest one
    (None when it has none: the run starts from step 0); a path -> that checkpoint, or the newest
    one under it when it is a run directory or a ``checkpoints/`` directory. ``field``: what a refusal
    names (the option, or the command-line argument that gave the path). ``true`` (as Hugging Face's
    ``resume_from_checkpoint=True``): this run directory's newest one, refused when it has none; ``false``: none."""
    if not resume or str(resume).lower() == "false":
        return None
    if str(resume).lower() == "true":
        found = complete(run_dir)
        if not found:
            raise ConfigError(f"{field}=true: this run directory ({run_dir}) has no checkpoint to resume from; "
                              f"{field}=auto starts from step 0 when there is none")
        return found[-1][1]
    if resume == "auto":
        found = complete(run_dir)
        return found[-1][1] if found else None
    path = os.path.expanduser(resume)
    if os.path.isfile(os.path.join(path, META)):
        return path
    for candidate in (path, os.path.dirname(path.rstrip("/"))):
        found = complete(candidate)
        if found:
            return found[-1][1]
    auto = ", or trainer.resume=auto" if field == "trainer.resume" else ""
    raise ConfigError(f"{field}={resume!r}: no checkpoint there (a checkpoint directory holds {META}; "
                      f"give checkpoints/step_<n> or a run directory with checkpoints/{auto})")


def read_meta(path: str) -> dict:
    """The checkpoint's ``meta.json``; one that is not the JSON object a save writes is refused, naming it."""
    file = os.path.join(path, META)
    try:
        with open(file, encoding="utf-8") as f:
            meta = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"checkpoint {path}: {file} is not a readable checkpoint record ({type(e).__name__}: "
                          f"{str(e)[:80]}); the checkpoint is damaged: resume from another one") from None
    if not isinstance(meta, dict) or "step" not in meta:
        raise ConfigError(f"checkpoint {path}: {file} holds no step; the checkpoint is damaged: resume from another one")
    return meta


def check_compatible(meta: dict, identity: dict, path: str) -> None:
    """Refuse a checkpoint written by a different world size, engine, strategy set or model."""
    diff = [f"{k}: checkpoint {meta.get(k)!r}, this run {v!r}" for k, v in identity.items() if meta.get(k) != v]
    if diff:
        raise ConfigError(f"checkpoint {path} cannot resume this run ({'; '.join(diff)}); resume with the "
                          "configuration that wrote it")


@contextlib.contextmanager
def _quiet():
    """DCP warns that it runs without a process group on one process; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _agree(ok: bool, device: torch.device) -> bool:
    """True when every rank says so."""
    if not torch.distributed.is_initialized():
        return ok
    flag = torch.tensor(float(ok), device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def rng_state(device: torch.device) -> dict:
    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _maybe_kill_inside_save(step: int, rank: int) -> None:
    """Fault injection for tests: ``MEMOPT_FAULT_SAVE=<step>[:<rank>]`` SIGKILLs that rank after its
    shard of checkpoint ``step`` is written and before the checkpoint is renamed into place."""
    want = os.environ.get(FAULT_ENV)
    if not want:
        return
    s, _, r = want.partition(":")
    if int(s) == step and int(r or 0) == rank:
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _maybe_fail_inside_save(step: int, rank: int, tmp: str) -> None:
    """Fault injection for tests: ``MEMOPT_FAULT_SAVE_ENOSPC=<step>:<rank>`` makes that rank's own files of
    checkpoint ``step`` fail as on a full disk (the other ranks' writes succeed)."""
    want = os.environ.get(FAULT_ENOSPC_ENV)
    if want and want == f"{step}:{rank}":
        import errno

        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(tmp, f"rank{rank}.files"))


def parts(engine) -> dict:
    """The engine's parts of a checkpoint (the weights' copies, its training state), as ``save`` builds
    them; the planner builds them on fake tensors to plan the save's peak."""
    return {"model": engine.checkpoint_model(), "engine": engine.checkpoint_state()}


def save(run_dir: str, step: int, engine, rank: int, device: torch.device, meta: dict, keep: int) -> str | None:
    """Write checkpoint ``step`` (a collective: every rank calls it) and keep the newest ``keep``; None
    (nothing written) when the weights are not finite."""
    import torch.distributed.checkpoint as dcp

    base = root(run_dir)
    tmp, final = os.path.join(base, f".tmp-step_{step}"), os.path.join(base, f"step_{step}")
    if rank == 0:
        for name in os.listdir(base) if os.path.isdir(base) else []:
            if name.startswith(".tmp-"):  # a save that was killed, or this one's leftover
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    state = {**parts(engine), "trainer": {f"rank{rank}": {"rng": rng_state(device)}}}
    if not _agree(all_finite(state["model"].values()), device):  # a checkpoint never holds a diverged state
        print(f"memopt: checkpoint at step {step} not written: the weights hold non-finite values", file=sys.stderr)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        return None
    # each phase's I/O failures are agreed on by every rank before any rank waits for the others' files:
    # a failure on some ranks only (a rank's engine files, rank 0's record) must not leave the rest at a barrier
    try:
        with _quiet():
            dcp.save(state, checkpoint_id=tmp)
        del state
        engine.save_files(tmp)
        _maybe_fail_inside_save(step, rank, tmp)
        reason = None
    except Exception as e:
        reason = _io_reason(e)
        if reason is None:
            raise
    _settle(reason, step, tmp, base, run_dir, device)
    _maybe_kill_inside_save(step, rank)
    _barrier()  # every rank's files are in place
    reason = None
    if rank == 0:
        try:
            with open(os.path.join(tmp, META), "w") as f:
                json.dump({**meta, "step": step}, f, indent=2, sort_keys=True)
            if os.path.isdir(final):  # the same step written again (a run resumed from an older checkpoint)
                shutil.rmtree(final)
            os.replace(tmp, final)
            for _, old in complete(run_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        except Exception as e:
            reason = _io_reason(e)
            if reason is None:
                raise
    _settle(reason, step, tmp, base, run_dir, device)
    return final


def _settle(reason: str | None, step: int, tmp: str, base: str, run_dir: str, device: torch.device) -> None:
    """Every rank learns whether any rank's write failed (``reason``: this rank's, None if none); if one
    did, every rank removes the partial files and raises ``CheckpointWriteError`` with the failing
    rank's reason."""
    if _agree(reason is None, device):
        return
    rank, why = (0, reason)
    if torch.distributed.is_initialized():
        reasons: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(reasons, reason)
        rank, why = next((r, x) for r, x in enumerate(reasons) if x is not None)
    shutil.rmtree(tmp, ignore_errors=True)  # the partial files would keep the disk full
    from memopt.logging import free_space

    last = complete(run_dir)
    where = f" (rank {rank})" if torch.distributed.is_initialized() else ""
    raise CheckpointWriteError(
        f"checkpoint step {step} could not be written to {tmp}{where}: {why} ({free_space(base)} free there); its "
        f"partial files were removed and the last complete checkpoint ({last[-1][1] if last else 'none'}) is "
        "intact: free space and continue with trainer.resume=auto") from None


class CheckpointWriteError(WriteError):
    """A checkpoint save failed on I/O (a full disk, a read-only or vanished directory)."""


def _io_reason(e: BaseException) -> str | None:
    """The OSError behind ``e`` (DCP wraps each rank's write failures), as 'strerror: file'; None if none."""
    seen, stack = set(), [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError):
            return f"{x.strerror or x}" + (f": {x.filename}" if getattr(x, "filename", None) else "")
        stack += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


def load(path: str, engine, rank: int, device: torch.device) -> int:
    """Restore ``engine`` and this rank's RNG states from checkpoint ``path``; returns its step."""
    import torch.distributed.checkpoint as dcp

    meta = read_meta(path)
    model = {}
    with _quiet():
        for unit in engine.checkpoint_model_units():  # the weights a unit at a time (a group's fp32 copy, not the model's)
            if unit:  # (every rank has the same units: the same collectives)
                dcp.load({"model": unit}, checkpoint_id=path)
            model.update(engine.load_model_unit(unit))
            del unit
        state = {"engine": engine.checkpoint_state(), "trainer": {f"rank{rank}": {"rng": rng_state(device)}}}
        dcp.load(state, checkpoint_id=path)
    engine.load_checkpoint(model, state["engine"])
    engine.load_files(path)
    set_rng_state(state["trainer"][f"rank{rank}"]["rng"], device)
    _barrier()
    return int(meta["step"])


def merge(path: str, out: str) -> str:
    """Write checkpoint ``path``'s weights as one ``model.pt`` (``memopt.load_model`` reads it): the file the run
    writes at its end, had it ended at that step (a LoRA run's adapters merged, or alone, as it saves them)."""
    import io

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from memopt.logging import atomic_write_bytes

    meta = read_meta(path)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)  # as torch.save's users expect of a tool
    tmp = f"{out}.dcp-{os.getpid()}"
    try:
        with _quiet():
            dcp_to_torch_save(path, tmp)
        full = torch.load(tmp, map_location="cpu", weights_only=True)  # tensors and plain containers only
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    record = {"model_config": meta["model_config"], "architecture": meta.get("architecture", {}),
              **({"tokenizer": meta["tokenizer"]} if meta.get("tokenizer") else {})}
    items = ((k, v.float()) for k, v in full["model"].items())
    lora = (meta.get("strategy_options") or {}).get("lora")
    if lora is not None:  # resumable checkpoints keep the adapters apart: write what the run's model.pt holds
        record, items = _lora_saved(record, items, lora, list(full["model"]))
    buf = io.BytesIO()
    torch.save({**record, "state_dict": dict(items)}, buf)
    atomic_write_bytes(out, buf.getvalue())
    return out


def _lora_saved(record: dict, items, lora: dict, names: list[str]):
    """A LoRA run's checkpoint as its ``model.pt`` (``strategy.lora.save``): the adapters merged into their
    base weights (W + alpha/rank B A), or the adapters alone with their record. The adapted layers are the ones
    whose adapters the checkpoint holds."""
    from memopt.strategies.lora import is_adapter, merged

    modules = sorted({n.rsplit(".", 1)[0] for n in names if is_adapter(n)})
    if lora.get("save") == "adapters":
        record = {**record, "lora": {"rank": lora["rank"], "alpha": lora["alpha"], "modules": modules}}
        return record, ((n, v) for n, v in items if is_adapter(n))
    return record, merged(items, lora["alpha"] / lora["rank"], modules)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m memopt.checkpoint", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="merge a sharded checkpoint's weights into one model.pt")
    m.add_argument("checkpoint", help="a checkpoints/step_<n> directory (or a run directory: its newest)")
    m.add_argument("out", help="the .pt file to write")
    args = p.parse_args(argv)
    try:
        src = resolve(args.checkpoint, args.checkpoint, field="checkpoint")
        print(f"wrote {merge(src, args.out)} from {src}")
    except ConfigError as e:  # a bad path or a damaged record: one line, no traceback
        print(f"memopt.checkpoint merge: refused: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the output cannot be written (permission, a file where a folder is wanted, space)
        print(f"memopt.checkpoint merge: refused: {args.out} cannot be written ({e.strerror or e}): give a writable "
              "path", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
