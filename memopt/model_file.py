"""model.pt, the final weights: written tensor by tensor, so no process ever holds the whole model.

Why: the weights of a 10B model are 38.5 GiB in fp32. Built as one state dict (and serialised into a
buffer) they cost that much host memory on every rank at the end of the run, more than the training
step itself on PatrickStar's node. Here rank 0 first writes the file's skeleton (``torch.save`` of fake
tensors under ``torch.serialization.skip_data``: the pickled structure and a hole for every storage),
then the engine streams the weights (``Engine.iter_full_state``: one gathered unit at a time, each
tensor a view of what the engine holds) and each tensor's bytes go straight into its hole, converted to
fp32 one tensor at a time on rank 0 (the other ranks only take part in the gathers: no copy at all). The result is an ordinary ``torch.save`` file (``torch.load``,
``memopt.load_model``); tied weights share one storage, as ``torch.save`` of the model's state dict
would write them. The file appears under its name only when every tensor is in (write to a temporary
name, fsync, rename), so a failure leaves the previous ``model.pt`` or none.

Where each storage's bytes go is read back from the skeleton itself: ``torch.load`` onto ``meta`` records
each storage's offset in the file (``_checkpoint_offset``; nothing is read or allocated).
"""
from __future__ import annotations

import ctypes
import os

import torch


def logical_model(record: dict, device: str | torch.device = "meta"):
    """The single-process model a ``model.pt`` record describes (``compose.model_record``): the model
    class with the architecture strategies (moe) installed; on ``meta`` it allocates nothing."""
    from memopt.models import ModelConfig, model_class
    from memopt.strategies.base import registry

    cfg = ModelConfig(**record["model_config"])
    strategies = registry()
    with torch.device(device):
        model = model_class(cfg)(cfg)
        for name, opts in record.get("architecture", {}).items():  # strategies that changed the model (moe)
            strategies[name].install(model, strategies[name].Config(**opts), cfg)
        if record.get("lora"):  # strategy.lora.save=adapters: the layout of the adapted model
            from memopt.strategies.lora import install_adapters

            lo = record["lora"]
            install_adapters(model, lo["modules"], lo["rank"], lo["alpha"], 0.0)
    return model


def host_fp32(value: torch.Tensor) -> torch.Tensor:
    """A weight as model.pt stores it: fp32, contiguous, on the host (``value`` itself when it is one)."""
    return value.detach().to("cpu", torch.float32).contiguous()


class Discard:
    """Rank 0's writer in a plan: the same conversion per tensor (``host_fp32``: the save's own bytes), no file."""

    def put(self, name: str, value: torch.Tensor) -> None:
        host_fp32(value)


def stream(engine, writer: "ModelFileWriter | Discard | None", check: bool = True, items=None) -> bool:
    """Every rank: iterate the engine's weights (a collective), rank 0 (``writer``) writing each as it
    arrives; whether every weight was finite (``check=False``: not looked at, the planner's fake
    tensors have no values). The planner runs this same loop (``Discard`` on rank 0), so what it plans
    is what the save holds."""
    from memopt.guards import all_finite

    finite = True
    for name, value in (engine.iter_full_state() if items is None else items):  # items: compose.saved_model's
        finite = finite and (not check or all_finite([value]))  # (identical on every rank: each sees every weight)
        if writer is not None and finite:
            writer.put(name, value)
        del value
    return finite


class ModelFileWriter:
    """Rank 0's side of a streamed ``model.pt``: ``put`` every weight once (any order), then ``commit``;
    ``abort`` on failure. The names and shapes are the record's model's state dict, in fp32."""

    def __init__(self, path: str, record: dict):
        from torch.utils._python_dispatch import _disable_current_modes

        self.path, self.tmp = path, f"{path}.tmp-{os.getpid()}"
        try:
            with _disable_current_modes():  # the skeleton is a file, never read: no memory a tracker should count
                self._skeleton(record)
        except BaseException:
            if os.path.exists(self.tmp):
                os.remove(self.tmp)
            raise
        self.fd = os.open(self.tmp, os.O_WRONLY)

    def _skeleton(self, record: dict) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        layout = logical_model(record).state_dict(keep_vars=True)
        if record.get("lora"):  # strategy.lora.save=adapters: the adapters alone
            from memopt.strategies.lora import is_adapter

            layout = {n: t for n, t in layout.items() if is_adapter(n)}
        fake, by_id = {}, {}
        with FakeTensorMode():
            for name, t in layout.items():  # tied weights: one fake tensor, hence one storage
                if id(t) not in by_id:
                    by_id[id(t)] = torch.empty(t.shape, dtype=torch.float32)
                fake[name] = by_id[id(t)]
        self.shapes = {name: tuple(t.shape) for name, t in layout.items()}
        self.storage_of = {name: id(t) for name, t in layout.items()}  # names sharing a storage
        self.missing = set(self.storage_of.values())
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save({**record, "state_dict": fake}, self.tmp)
        self.offset = self._offsets()

    def _offsets(self) -> dict[str, int]:
        # loaded onto ``meta``, each storage records where its bytes start in the file
        skeleton = torch.load(self.tmp, map_location="meta", weights_only=True)["state_dict"]
        off = {n: getattr(t.untyped_storage(), "_checkpoint_offset", None) for n, t in skeleton.items() if t.numel()}
        if any(o is None for o in off.values()):
            raise RuntimeError("model.pt: this torch does not report storage offsets of a checkpoint loaded on meta")
        return off

    def put(self, name: str, value: torch.Tensor) -> None:
        if name not in self.shapes:
            raise KeyError(f"model.pt: {name!r} is not a weight of the model ({len(self.shapes)} names)")
        if tuple(value.shape) != self.shapes[name]:
            raise ValueError(f"model.pt: {name} has shape {tuple(value.shape)}, the model's is {self.shapes[name]}")
        if value.numel():
            data = host_fp32(value)  # often the engine's own buffer: read through ctypes, since ``.numpy()``
            raw = (ctypes.c_char * (data.numel() * 4)).from_address(data.data_ptr())  # marks a storage unresizable
            view, pos = memoryview(raw).cast("B"), self.offset[name]
            while view:  # pwrite may write less than asked
                n = os.pwrite(self.fd, view, pos)
                view, pos = view[n:], pos + n
        self.missing.discard(self.storage_of[name])

    def commit(self) -> str:
        if self.missing:
            names = sorted(n for n, s in self.storage_of.items() if s in self.missing)
            self.abort()
            raise RuntimeError(f"model.pt: {len(names)} weight(s) never arrived: {names[:5]}")
        os.fsync(self.fd)
        os.close(self.fd)
        os.replace(self.tmp, self.path)
        return self.path

    def abort(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
        if os.path.exists(self.tmp):
            os.remove(self.tmp)
