"""One rank's training step, run for real on fake tensors: the bytes the run would hold, by category.

``simulate_rank`` builds the engine exactly as a training rank does (``engines.build_engine``: the
composition, the partitioner or chunk manager, initialisation from the seed, the optimizer) and runs
the loop's calls (two steps: the first allocates lazily created states and is the chunk engine's
warm-up; an evaluation; the checkpoint's state dict) under ``FakeTensorMode``, with the run's own
memory tracker counting the fake tensors' storages. Other ranks are PyTorch's fake process group
(backend ``fake``: collectives return at once), so rank r of a world of 64 runs in one process.
Nothing model-sized is allocated: a fake tensor has shape, dtype and device, no data.

Values are not computed, so a value-dependent decision takes a fixed answer: ``.item()`` reads the
constant FakeTensorMode propagated (step counters, flags made from Python numbers), the healthy answer
for a boolean ``all`` (True: every gradient finite) or ``any`` (False: none is bad), otherwise 0 (no
fp16 overflow, gradient norm 0: no clipping, no skipped step). Where a run's bytes depend on
values (MoE routing: how many assignments each expert keeps, the dropless capacity) the plan takes
the case that bounds them from above (``planner/routing.py``).

The tracker also counts what crosses links in the second (steady-state) step: collectives (bus bytes
as nccl-tests define them), both the ProcessGroup ones behind ``dist.*`` (flat groups, ZeRO, FSDP2)
and the functional ones DTensor's tensor-parallel layers issue (``_c10d_functional.*``, group named),
and copies between the compute device and the host. Per kind it also keeps calls and payload bytes
in ``memopt.parallel.comm``'s convention, so a plan compares with a run's ``trainer.count_comm``.
It counts the parameters the host's AdamW updates in that step as well (``host_adam_updates``).
"""
from __future__ import annotations

import contextlib
import time
import weakref
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from memopt.errors import ConfigError
from memopt.memory.tracker import HOST, MemoryTracker
from memopt.planner import fast_ops
from memopt.planner.routing import planned_routing


def _flop_formulas() -> dict:
    """PyTorch's FLOP formulas by op (those of ``FlopCounterMode``, whose module tracker would keep
    tensors alive across checkpoints; the tracker applies them itself). The CPU kernel of fused
    attention has none in torch 2.13; its arguments lead with those of the flash kernel's, so it takes
    that formula (4 B H T^2 D forward, twice that backward: the 12 L C T of the model's formula)."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    out = dict(flop_registry)
    for cpu, like in ((aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention),
                      (aten._scaled_dot_product_flash_attention_for_cpu_backward,
                       aten._scaled_dot_product_flash_attention_backward)):
        if cpu not in out and like in out:
            out[cpu] = out[like]
    return out


def _split_over_mesh(out) -> int:
    """How many ranks share the work of an op on DTensors: the tracker sees the op with global shapes
    (the local op runs below the dispatch modes), and each mesh dimension where the output is Shard
    or Partial splits the work over its ranks (Replicate: every rank computes the whole, counted
    whole). 1 for plain tensors."""
    from torch.distributed.tensor import DTensor

    first = next((t for t in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(t, DTensor)), None)
    if first is None:
        return 1
    n = 1
    for size, p in zip(first.device_mesh.shape, first.placements):
        if p.is_shard() or p.is_partial():
            n *= size
    return n


_FLOPS = _flop_formulas()
_aten = torch.ops.aten
# fused attention's kernels: its FLOPs run at a rate of their own (``hardware.attention_efficiency``)
ATTENTION = frozenset(getattr(_aten, n) for n in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward") if hasattr(_aten, n))
# the activation function whose bytes run at a rate of their own (``hardware.activation_gbps``, timed on it by the CPU
# probe): on a CPU thread GELU (tanh) and its backward move 1.5-5 GB/s where adds, casts and LayerNorm move 13-45.
# SiLU (Llama's) is not timed and stays at the memory rate: one thread ran it 1.7x faster per byte than GELU (tanh)
ACTIVATION_FNS = frozenset((_aten.gelu, _aten.gelu_backward))


def op_work(func, args, kwargs, out, moves: bool = True) -> tuple[int, int]:
    """(FLOPs, bytes moved) of one op as the step time counts them: an op with a FLOP formula is compute,
    any other that is not a view or a collective moves its arguments and outputs (``moves``: count those).
    The plan and the CPU probes that calibrate its rates (cpu_rates/) count by this one rule."""
    formula = _FLOPS.get(func._overloadpacket)
    if formula is not None:
        return int(formula(*args, **(kwargs or {}), out_val=out)), 0
    if moves and not func.is_view and func.namespace not in ("c10d", "_c10d_functional"):
        return 0, _moved_bytes(args, kwargs, out)
    return 0, 0


def _moved_bytes(args, kwargs, out) -> int:
    """Bytes a memory-bound op reads and writes: its tensor arguments and outputs (an in-place op's
    output is the tensor it read, written back: counted twice, as it moves twice)."""
    return sum(t.nbytes for t in tree_leaves((args, kwargs or {}, out)) if isinstance(t, torch.Tensor))


def _on_dtensors(args) -> bool:
    """An op on DTensors (tensor parallelism): the tracker sees it once, above DTensor's own dispatch,
    whose sharding propagation costs a run far more host time than a plain op's."""
    return any(isinstance(a, DTensor) for a in tree_leaves(args))  # lists too: the optimizer's foreach ops


class PlanUnsupported(ConfigError):
    """A composition the fake step cannot follow (named, with what to do instead)."""


class PlanOverflow(RuntimeError):
    """The simulated rank went over a limit (preflight stops at the first op that does)."""

    def __init__(self, device: str, live: dict[str, int], limit: int, reason: str | None = None, fixes=(),
                 at_build: bool = False):
        folded: dict[str, int] = defaultdict(int)  # as the run's tracker names them: a forward's transient bytes
        for c, b in live.items():  # are the activations it is making
            folded["activations" if c == "_forward" else c.lstrip("_")] += b
        self.device, self.live, self.limit = device, dict(folded), limit
        self.fixes = list(fixes)  # the engine's own ways out (ChunkOutOfMemoryError.fixes), as (field, value) pairs
        self.total = sum(live.values())
        self.category = max(self.live, key=self.live.get) if self.live else "other"
        self.reason = reason  # the engine's own out-of-memory message (the chunk engine checks its budgets at build)
        self.at_build = at_build  # raised while the engine was built: by its states, before any micro-batch
        super().__init__(reason or f"{device} over {limit} bytes ({self.category} largest)")


# a limit on the compute device's activations alone: an engine planned by its own rules on memopt's fake step
# (DeepSpeed) holds at least those beside whatever else, so the fake step can stop once they alone are over
ACTIVATIONS = "device_activations"
NOT_COMPUTE = ("params", "grads", "optim", "chunks", "comm", "other")  # model states and the engine's own buffers


class PlanTracker(MemoryTracker):
    """The run's tracker, counting fake tensors, answering ``.item()`` and counting link traffic."""

    def __init__(self, compute_device, limits: dict[str, int] | None = None):
        super().__init__(compute_device)
        self.limits = dict(limits or {})
        self.counting = False
        self.traffic: dict[str, int] = defaultdict(int)  # comm_bytes, offload_bytes, host_optim_params, ops, op_bytes
        # (grad_op_bytes of them written into kept gradients), dtensor_ops, collectives (counting windows only; what
        # the step time's terms divide)
        self.comm_ops: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0, "bus_bytes": 0})
        self._healthy: dict[int, tuple] = {}  # bool results of all/any: the value a healthy step reads
        self.backward_nonmodel: dict[str, int] | None = None  # set to {}: the peak of the bytes outside the model
        # states while it is a dict (the last step's forward and backward: DeepSpeed's rules add it, planner/engines/deepspeed)
        self.grad_ready_nonmodel: list[int] | None = None  # meanwhile: those bytes on the compute device as each
        # gradient is registered (stage 3 plans the moment DeepSpeed's first bucket fills, planner/engines/deepspeed)
        self.recompute_nonmodel: list[int] | None = None  # meanwhile: their peak from the start of each recomputation
        # in the backward to the next gradient's arrival (its block's backward; stage 3 plans it, planner/engines/deepspeed)
        self._recomputing = False  # such a window is open (the last entry of ``recompute_nonmodel``)
        self.backward_with_grads: dict[str, int] | None = None  # meanwhile: the peak of those bytes beside every
        # gradient autograd has produced so far, each as its own tensor (DeepSpeed's stage 1 keeps each param.grad
        # until its reductions after the backward; memopt accumulates into a flat buffer allocated whole)
        self._arrived = 0  # bytes of those gradients, each parameter's once a step (accumulating adds into it)
        self._arrived_from: set[int] = set()  # the parameters counted in ``_arrived``
        self.arrivals: list[list[int]] | None = None  # set to []: at each parameter's gradient in the last step's
        # first backward, [its index in the model's parameters, the compute bytes then, their peak until the next
        # gradient or the backward's end] (DeepSpeed's stage 2 reduces a bucket when the next gradient would
        # overflow it: planner/engines/deepspeed)
        self._param_index: dict[int, int] = {}

    def register_module(self, module: torch.nn.Module) -> None:
        super().register_module(module)
        self._param_index = {id(p): i for i, p in enumerate(module.parameters())}
        for p in module.parameters():
            if p.requires_grad and not getattr(p, "_plan_arrival_hooked", False):
                p.register_post_accumulate_grad_hook(self._grad_arrived)
                p._plan_arrival_hooked = True

    def _grad_arrived(self, p: torch.Tensor) -> None:
        if self.backward_with_grads is not None and id(p) not in self._arrived_from:
            self._arrived_from.add(id(p))
            self._arrived += p.numel() * p.grad.element_size()
            if self.arrivals is not None:
                b = self._compute_bytes(self.compute_key)
                self.arrivals.append([self._param_index.get(id(p), -1), b, b])
            self._update_peak(self.compute_key)

    def counters(self) -> tuple[dict, dict]:
        """A copy of what the counted step has counted so far (traffic, collectives by kind)."""
        return dict(self.traffic), {k: dict(v) for k, v in self.comm_ops.items()}

    def repeat_since(self, before: tuple[dict, dict], times: int) -> None:
        """Count what was counted since ``before`` (``counters``) ``times`` more: micro-batches not run
        that would have counted the same (``sampled_micro_batches``)."""
        traffic, comm = before
        for k, v in list(self.traffic.items()):
            self.traffic[k] += (v - traffic.get(k, 0)) * times
        for kind, rec in list(self.comm_ops.items()):
            was = comm.get(kind, {})
            for k, v in list(rec.items()):
                rec[k] += (v - was.get(k, 0)) * times

    @contextlib.contextmanager
    def retained(self, name: str = "activations", transient: str = "_forward"):
        if self.recompute_nonmodel is not None and not self._recomputing and torch._C._current_graph_task_id() != -1:
            self._recomputing = True  # a checkpoint recomputing its forward (retained inside a backward)
            self.recompute_nonmodel.append(0)
            self._update_peak(self.compute_key)
        with super().retained(name, transient):
            yield

    def register(self, t: torch.Tensor, category: str, device: str | None = None) -> None:
        first = category == "grads" and self.grad_ready_nonmodel is not None
        if first:  # a gradient once, when it becomes one (not when re-tagged)
            info = self._info.get(id(t.untyped_storage()))
            first = info is None or info.category != "grads"
        super().register(t, category, device)
        if first:
            self.grad_ready_nonmodel.append(self._compute_bytes(self.compute_key))
            self._recomputing = False

    @staticmethod
    def _counted(t: torch.Tensor) -> bool:
        return MemoryTracker._counted(t) or type(t).__name__ == "FakeTensor"

    def _compute_bytes(self, device: str) -> int:
        """Live bytes on ``device`` outside the model states and the engine's own buffers."""
        live = self.live[device]
        return sum(live.values()) - sum(live.get(c, 0) for c in NOT_COMPUTE)

    def _update_peak(self, device: str) -> int:
        total = super()._update_peak(device)
        if self.backward_nonmodel is not None:
            b = self._compute_bytes(device)
            if b > self.backward_nonmodel.get(device, 0):
                self.backward_nonmodel[device] = b
            if device == self.compute_key and b + self._arrived > self.backward_with_grads.get(device, 0):
                self.backward_with_grads[device] = b + self._arrived
            if device == self.compute_key and self.arrivals:  # (None or empty: no window open)
                self.arrivals[-1][2] = max(self.arrivals[-1][2], b)
            if self._recomputing and device == self.compute_key:
                self.recompute_nonmodel[-1] = max(self.recompute_nonmodel[-1], b)
        limit = self.limits.get(device)
        if limit is not None and sum(self.live[device].values()) > limit:
            raise PlanOverflow(device, dict(self.live[device]), limit)
        limit = self.limits.get("activations")  # the compute device's activations alone (``ACTIVATIONS``)
        if limit is not None and device == self.compute_key and self.live[device].get("activations", 0) > limit:
            raise PlanOverflow(device, {"activations": self.live[device]["activations"]}, limit)
        limit = self.limits.get("all")  # one memory for every key (a CPU-only machine: device = host RAM)
        if limit is not None:
            live = defaultdict(int)
            for cats in self.live.values():
                for c, b in cats.items():
                    live[c] += b
            if sum(live.values()) > limit:
                raise PlanOverflow("all", dict(live), limit)
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:  # a fake tensor's device, asked from C++ (Python indexing, autograd's checks): a third of
            return fast_ops.device(args)  # the ops a plan sees; nothing to count, so not through the tracker's own dispatch
        if func is _IS_PINNED:  # fake tensors have no pinned memory: a host tensor is pinned (FSDP2's offload pins them)
            return self._device_of(args[0]) == HOST
        if func is torch.ops.aten._local_scalar_dense.default:
            ref, healthy = self._healthy.get(id(args[0]), (None, None))
            return healthy if ref is not None and ref() is args[0] else _scalar(args[0])
        src = self._device_of(args[1]) if self.counting and func is torch.ops.aten.copy_.default else None
        if src is not None and self._device_of(args[0]) in (None, src):  # a copy on one memory: a memory-bound op
            src = None
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.counting and func.namespace in ("c10d", "_c10d_functional"):
            self._count_collective(func, args, kwargs or {}, out)
        if func._overloadpacket in _HEALTHY and isinstance(out, torch.Tensor) and out.dtype == torch.bool:
            self._healthy[id(out)] = (weakref.ref(out), _HEALTHY[func._overloadpacket])  # isfinite(g).all() holds, isinf(g).any() does not
        if self.counting:
            self.traffic["ops"] += 1
            flops, moved = op_work(func, args, kwargs, out, moves=src is None)  # a copy_ between memories: offload, below
            if flops or moved:
                split = _split_over_mesh(out)
                self.traffic["flops"] += flops // split
                if func._overloadpacket in ATTENTION:
                    self.traffic["attention_flops"] += flops // split
                self.traffic["op_bytes"] += moved // split
                if func._overloadpacket in ACTIVATION_FNS:
                    self.traffic["activation_bytes"] += moved // split
                if moved and self._writes_grads(out):  # the engine's own gradient handling (DeepSpeed's rules
                    self.traffic["grad_op_bytes"] += moved // split  # replace memopt's with DeepSpeed's)
            if _on_dtensors(args):
                self.traffic["dtensor_ops"] += 1
            if src is not None:
                self.traffic["offload_bytes"] += args[1].nbytes
            elif func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor):
                a, b = self._device_of(args[0]), self._device_of(out)
                if a is not None and b is not None and a != b:
                    self.traffic["offload_bytes"] += out.nbytes
        return out

    def _writes_grads(self, out) -> bool:
        """The op's output is a gradient the engine keeps (its storage counted as ``grads``), or the op is part of
        the engine's gradient handling (``grad_path``: a reduction's flat copies)."""
        if self.grad_path_depth:
            return True
        if not isinstance(out, torch.Tensor):
            return False
        info = self._info.get(id(out.untyped_storage()))
        return info is not None and info.category == "grads"

    def _run(self, func, args, kwargs):
        if func is _PIN:  # NYI for fake tensors in torch: pinning copies into new (host) memory
            return torch.ops.aten.clone.default(args[0])
        out = fast_ops.run(func, args, kwargs)
        return func(*args, **(kwargs or {})) if out is NotImplemented else out

    def _device_of(self, t) -> str | None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":  # not ``is_meta`` (an op on a fake tensor)
            return None
        info = self._info.get(id(t.untyped_storage()))
        return info.device if info is not None else self._device_key(t)

    def _count_collective(self, func, args, kwargs, out) -> None:
        """Bus bytes of one collective (nccl-tests' convention): all-reduce 2(n-1)/n x size,
        all-gather / reduce-scatter / all-to-all (n-1)/n x the full buffer, broadcast and send x size
        (a receive counts nothing: its sender counts the transfer, on a full-duplex link); n is the
        size of its group (a ProcessGroup argument, or the group name of a functional collective).
        Kinds of ``memopt.parallel.comm`` also get calls and payload bytes (its convention)."""
        from memopt.parallel.comm import KINDS, _bytes, _payload

        n = _group_size(func, args, kwargs)
        if n <= 1:
            return
        kind = KINDS.get(func._schema.name.split("::")[-1])
        if kind is None:  # wait_tensor, barrier, ...: nothing of their own crosses a link
            return
        payload = _bytes(_payload(func.namespace, kind, args, out))
        factor = 2 * (n - 1) / n if kind == "all_reduce" else 1.0 if kind in ("broadcast", "reduce", "send") else \
            0.0 if kind == "recv" else (n - 1) / n  # point-to-point: the sender's payload (links are full duplex)
        bus = int(payload * factor)
        self.traffic["comm_bytes"] += bus
        self.traffic["collectives"] += 1
        rec = self.comm_ops[kind]
        rec["count"] += 1
        rec["bytes"] += payload
        rec["bus_bytes"] += bus

    def comm_per_step(self) -> dict:
        """The counted step's collectives as ``trainer.count_comm`` records them, plus bus bytes."""
        ops = {k: dict(v) for k, v in sorted(self.comm_ops.items())}
        return {"ops": ops, "bytes": sum(v["bytes"] for v in ops.values()),
                "count": sum(v["count"] for v in ops.values()), "bus_bytes": sum(v["bus_bytes"] for v in ops.values())}


def _group_size(func, args, kwargs) -> int:
    """Ranks in the collective's group: a ProcessGroup argument (``c10d`` ops), or the group a
    functional collective names (``group_name``); the world when neither is found."""
    group = kwargs.get("group_name")
    if group is None:
        for a, arg in zip(args, func._schema.arguments):
            if arg.name == "group_name":
                group = a
        if group is None:
            group = next((a for a in args if not isinstance(a, torch.Tensor) and callable(getattr(a, "size", None))), None)
    try:
        if isinstance(group, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = _resolve_process_group(group)
        return group.size() if group is not None else dist.get_world_size()
    except Exception:
        return 1


_HEALTHY = {torch.ops.aten.all: True, torch.ops.aten.any: False}
_DEVICE = torch.ops.prim.device.default
_PIN, _IS_PINNED = torch.ops.aten._pin_memory.default, torch.ops.aten.is_pinned.default


def _scalar(t):
    """``.item()`` of a fake tensor: its value when FakeTensorMode propagated it as a constant (a step
    counter, a flag built from a Python number), else 0 (no overflow, gradient norm 0)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    c = getattr(t, "constant", None)
    if c is None:
        return False if t.dtype == torch.bool else 0
    with unset_fake_temporarily():
        return c.item()


class _HeldWork:
    """An async reduce-scatter's Work: ``wait`` allocates gloo's scratch, kept while the caller holds the Work."""

    def __init__(self, work, like):
        self.work, self.like, self.scratch = work, like, None

    def wait(self, *args, **kwargs):
        if self.scratch is None:
            self.scratch = torch.empty_like(self.like)
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


@contextlib.contextmanager
def gloo_scratch():
    """gloo's single-tensor reduce-scatter (FSDP2's) materialises an input-sized scratch on the calling
    thread: inside the call (sync; freed when it returns) or in ``wait`` (async; alive until the caller drops
    the Work), as the tracker measures it. The fake process group allocates nothing, so a plan of a gloo run
    (CPU devices) adds that scratch where the run has it; NCCL needs none, so GPU plans leave it out.
    memopt's own reduce-scatter uses gloo's list form, which makes none (``dims.reduce_scatter_single``;
    in the fake world it takes the single-tensor path, unpatched)."""
    from memopt.parallel import dims as dims_mod

    original = dims_mod._reduce_scatter_tensor

    def reduce_scatter(*args, async_op=False, **kwargs):
        inp = args[1] if len(args) > 1 else kwargs.get("input")
        work = original(*args, async_op=async_op, **kwargs)
        if not async_op or work is None:
            torch.empty_like(inp)  # counted at its peak and freed at once
            return work
        return _HeldWork(work, inp)

    # FSDP2 (dist.reduce_scatter_single) reaches gloo through these names
    patched = [(dist, n) for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]
    saved = [(mod, n, getattr(mod, n)) for mod, n in patched]
    for mod, n in patched:
        setattr(mod, n, reduce_scatter)
    try:
        yield
    finally:
        for mod, n, f in saved:
            setattr(mod, n, f)


@contextlib.contextmanager
def host_adam_updates(tracker: PlanTracker):
    """Count, in the counting step, the parameters whose AdamW update runs on the host: every ``CPUAdamW``
    step (ZeRO's cpu_offload: the rank's owned partition; the chunk engine: its optimizer groups left on the
    host) adds the elements it updates to ``traffic["host_optim_params"]``, the step-time estimate's
    optimizer term (``plan.step_time``). FSDP2's offloaded step (``torch.optim.AdamW`` on host shards) is not
    ``CPUAdamW`` and is not counted."""
    from memopt.optim.cpu_adam import CPUAdamW

    step, views = CPUAdamW.step, CPUAdamW.step_views

    def counted_step(self, grads, *args, **kwargs):
        if tracker.counting:
            tracker.traffic["host_optim_params"] += sum(p.numel() for p, g in zip(self.params, grads) if g is not None)
        return step(self, grads, *args, **kwargs)

    def counted_views(self, ps, *args, **kwargs):
        if tracker.counting:
            tracker.traffic["host_optim_params"] += sum(p.numel() for p in ps)
        return views(self, ps, *args, **kwargs)

    CPUAdamW.step, CPUAdamW.step_views = counted_step, counted_views
    try:
        yield
    finally:
        CPUAdamW.step, CPUAdamW.step_views = step, views


REPEAT_FROM = 4  # micro-batches a step from which the middle ones are run once (3 would skip none)


def sampled_micro_batches(n: int, repeat: bool) -> tuple[list[int], int]:
    """(the micro-batches of a step of ``n`` that the fake step runs, how many micro-batches the second stands
    for). ``repeat`` (``Wing.micro_batches_repeat``): between the first (which makes the gradients) and the last
    (which reduces them), every micro-batch holds the same bytes at the same moments and counts the same ops and
    collectives as the second, so the second is run once and its counts taken n - 2 times: a plan at 4 x 8
    costs 3 micro-batches a step, not 8 (``trainer.plan_exact=true`` runs every one; tested against that,
    ``tests/planner/test_micro_batches.py``)."""
    if not repeat or n < REPEAT_FROM:
        return list(range(n)), 1
    return [0, 1, n - 1], n - 2


def simulate_rank(cfg, rank: int, world: int, limits: dict[str, int] | None = None, steps: int = 2,
                  backend: str = "gloo") -> dict:
    """Peaks {"device"|"host": {category: bytes, "total": bytes}}, the steady step's traffic and its
    FLOPs (PyTorch's FLOP formulas applied op by op), for rank ``rank`` of ``world``.

    ``limits`` ({"device": bytes, "host": bytes, "all": bytes for their sum, ``ACTIVATIONS``: bytes of the device's
    activations alone}): raise ``PlanOverflow`` at the first op that
    goes over (the preflight needs no more than that). ``backend``: the collectives' backend of the
    planned run (gloo for CPU devices, nccl for GPUs), for its scratch buffers."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

    from memopt import checkpoint, compose, engines, model_file
    from memopt.data import TokenBatches, load_tokens
    from memopt.parallel.dims import build_dims
    from memopt.planner.engines import wing

    t0 = time.perf_counter()
    w = wing(cfg)
    patch = w.step_patch(cfg, backend) if w.step_patch else None  # copies the fake step makes explicit (FSDP2 offload)
    device = torch.device("cpu")  # bytes do not depend on the device; placement is logical (host_scope)
    keymap = {"cpu": "device", HOST: "host"}
    inverse = {**{v: k for k, v in keymap.items()}, "all": "all", ACTIVATIONS: "activations"}
    tracker = PlanTracker(device, {inverse[k]: v for k, v in (limits or {}).items() if v is not None})
    started = _join_fake_world(rank, world, always=w.process_group_always)  # FSDP2: a group even for one rank
    try:
        dims = build_dims(cfg.parallel, "cpu")
        if w.process_group_always and world == 1 and dims.dp_shard.mesh is None:  # the mesh FSDP2 would make, made before the
            from torch.distributed.device_mesh import init_device_mesh  # fake mode (its coordinates are values)

            dims.dp_shard.mesh = init_device_mesh("cpu", (1,))
        t = cfg.trainer
        with tracker, _quiet_pipeline_schedules():
            data = TokenBatches(load_tokens(cfg.data, cfg.seed), cfg.model.seq_len, cfg.data.val_fraction, cfg.seed)
            with FakeTensorMode(allow_non_fake_inputs=True), planned_routing(), \
                    (gloo_scratch() if backend == "gloo" else contextlib.nullcontext()), \
                    (patch(tracker) if patch else contextlib.nullcontext()), host_adam_updates(tracker):
                try:
                    engine = engines.build_engine(cfg, device, dims, tracker)
                except PlanOverflow as e:
                    e.at_build = True  # its states alone, before any micro-batch (``prune.plan_chain``)
                    raise
                engine.model.train()
                # the held-out batches the trainer builds before its steps and keeps through the run (device bytes
                # on a CPU run): a plan without them was 32 KB under a run it let through at a budget (llama_tiny)
                evals = t.eval_every and len(data.val) > cfg.model.seq_len
                with tracker.host_scope() if backend != "gloo" else contextlib.nullcontext():  # a GPU run's: host memory
                    eval_set = data.eval_batches(t.eval_batches, t.micro_batch_size) if evals else []
                data_bytes = 0
                micros, stands_for = sampled_micro_batches(t.grad_accum, w.micro_batches_repeat and not t.plan_exact)
                for step in range(steps):
                    last = step == steps - 1
                    tracker.counting = last
                    tracker.backward_nonmodel = {} if last else None
                    tracker.backward_with_grads, tracker._arrived = ({} if last else None), 0
                    tracker._arrived_from, tracker.arrivals = set(), ([] if last else None)
                    arrivals = []
                    tracker.grad_ready_nonmodel = [] if last else None
                    tracker.recompute_nonmodel, tracker._recomputing = ([] if last else None), False
                    for micro in micros:
                        before = tracker.counters() if last and micro == 1 and stands_for > 1 else None
                        x, y = data.micro_batch(step, micro, dims.dp.rank, dims.dp.size, t.micro_batch_size, t.grad_accum)
                        with tracker.category("other"):
                            x, y = x.to(device), y.to(device)
                        if last and micro == 0:  # the run's data and buffers (DeepSpeed's rules add them to its moments)
                            data_bytes = tracker.live[tracker.compute_key].get("other", 0)
                        engine.forward_backward(x, y, micro, t.grad_accum)
                        if tracker.arrivals is not None:  # the first backward's: closed
                            arrivals, tracker.arrivals = tracker.arrivals, None
                        if before is not None:
                            tracker.repeat_since(before, stands_for - 1)
                    nonmodel, tracker.backward_nonmodel = tracker.backward_nonmodel or {}, None
                    with_grads, tracker.backward_with_grads = tracker.backward_with_grads or {}, None
                    grad_ready, tracker.grad_ready_nonmodel = tracker.grad_ready_nonmodel or [], None
                    recompute, tracker.recompute_nonmodel = tracker.recompute_nonmodel or [], None
                    moved = tracker.traffic["op_bytes"] - tracker.traffic["grad_op_bytes"]
                    offloaded = tracker.traffic["offload_bytes"]
                    with tracker.category("temp"):
                        engine.step(1e-3)
                    if last:  # the engine's step but for its gradients' (DeepSpeed's rules replace memopt's with DeepSpeed's)
                        tracker.traffic["step_op_bytes"] += tracker.traffic["op_bytes"] - tracker.traffic["grad_op_bytes"] - moved
                        # its copies between memories (the chunk engine's chunks): a rate measured over a whole step holds some
                        tracker.traffic["step_offload_bytes"] += tracker.traffic["offload_bytes"] - offloaded
                    tracker.counting = False
                metrics = engine.step_metrics() if hasattr(engine, "step_metrics") else {}
                if eval_set:
                    x, y = eval_set[0]
                    with tracker.category("temp"):
                        engine.eval_loss(x.to(device), y.to(device))
                if t.save_checkpoint:  # fp32 CPU copies: host memory of a GPU run (the device itself on a CPU run)
                    with tracker.category("other"), (tracker.host_scope() if backend != "gloo" else contextlib.nullcontext()):
                        items = compose.saved_model(cfg, engine.iter_full_state())[1]  # lora: the merge's copies too
                        model_file.stream(engine, model_file.Discard() if rank == 0 else None, check=False, items=items)  # the save's loop
                if t.checkpoint_every:  # a resumable checkpoint's state dict (the weights' copies): a temporary, as the run counts it
                    with tracker.category("temp"), (tracker.host_scope() if backend != "gloo" else contextlib.nullcontext()):
                        checkpoint.parts(engine)
    except PlanOverflow as e:
        e.device = keymap.get(e.device, e.device)
        raise
    except (DynamicOutputShapeException, DataDependentOutputException) as e:
        raise PlanUnsupported(
            f"the planner cannot follow {cfg.strategy.selected() or 'this model'}: {e.func} has a data-dependent "
            "shape or value, which fake tensors do not have (MoE routing has a planned answer, planner/routing.py; "
            "this op has none); run with trainer.preflight=false") from None
    except Exception as e:
        cause = e.__cause__
        while cause is not None and not isinstance(cause, PlanOverflow):  # torch's pipelining wraps a stage's
            cause = cause.__cause__  # exception in a RuntimeError: the overflow inside is the plan's answer
        if cause is not None:
            cause.device = keymap.get(cause.device, cause.device)
            raise cause from None
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
            raise PlanOverflow("host" if "host" in str(e) else "device", {}, 0, f"{type(e).__name__}: {e}",
                               getattr(e, "fixes", ())) from None
        raise
    finally:
        if started:
            dist.destroy_process_group()
            _forget_dtensor_plans()
    peaks = {keymap.get(d, d): v for d, v in tracker.peaks().items()}
    traffic = dict(tracker.traffic)
    return {"rank": rank, "peaks": peaks, "traffic": traffic, "flops": traffic.pop("flops", 0),
            "comm_per_step": tracker.comm_per_step(), "seconds": time.perf_counter() - t0, "engine_metrics": metrics,
            "backward_nonmodel": {keymap.get(d, d): v for d, v in nonmodel.items()}, "grad_ready_nonmodel": grad_ready,
            "recompute_nonmodel": recompute, "data": data_bytes, "backward_with_grads": {keymap.get(d, d): v for d, v in with_grads.items()},
            "grad_arrivals": arrivals}


@contextlib.contextmanager
def fake_world(cfg, rank: int, world: int):
    """The parallel dimensions of rank ``rank`` of a fake world (for layout questions, no tensors)."""
    from memopt.parallel.dims import build_dims

    started = _join_fake_world(rank, world)
    try:
        yield build_dims(cfg.parallel, "cpu")
    finally:
        if started:
            dist.destroy_process_group()
            _forget_dtensor_plans()


def _forget_dtensor_plans() -> None:
    """DTensor caches its sharding decisions by op and input specs, and a spec's mesh compares equal to
    another rank's mesh of the same shape; the cached output spec then carries the previous simulated
    rank's mesh, whose group names died with its fake world (rank 3 of tp 2 x dp 2 failed to resolve
    rank 0's tp group). Each simulated rank starts with empty caches."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._redistribute import _gen_transform_infos
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:
        return
    prop = DTensor._op_dispatcher.sharding_propagator
    for cache in (getattr(prop, "propagate_op_sharding", None), _gen_transform_infos,
                  getattr(ShardingPropagator, "_propagate_tensor_meta_cached", None)):
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's own
    if native is not None:
        native()


@contextlib.contextmanager
def _quiet_pipeline_schedules():
    """torch's pipeline schedules log every exception of a stage at ERROR before re-raising it; in a plan the
    exception is the planner's overflow, which the plan reports (auto printed 8 such tracebacks for its
    pipeline candidates that did not fit)."""
    import logging

    log = logging.getLogger("torch.distributed.pipelining.schedules")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _join_fake_world(rank: int, world: int, always: bool = False) -> bool:
    """This process as rank ``rank`` of a fake world (no-op collectives); False for one rank (unless
    ``always``: an engine that needs a process group even then)."""
    if world <= 1 and (not always or dist.is_initialized()):  # a one-rank group already made does as well
        return False
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the planner simulates other ranks with a fake process group; plan before joining a real one")
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    return True
