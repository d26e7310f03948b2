"""``ChunkEngine``: the training loop's interface over the chunk manager, hooks, tracer and optimizer.

``build`` is the engine registry's entry (``engine=memopt`` with ``+strategy=chunk``): it builds the
model on ``meta`` with the model-phase strategies applied (``compose.model_on_meta``), resolves the
precision and calls ``build_chunk_engine``, which packs the parameters into chunks (on the host), fills them from the seed with the same
per-parameter initialisation as every other engine, installs the hooks and builds the optimizer.

Life of a run: the first optimizer step (all its micro-steps) is the warm-up: chunks are limited to
W and the tracer records the trace. After it: budgets per moment (dynamic) or W (static), Belady
eviction, and with Hybrid Adam the optimizer groups the margin allows are moved to the device.
"""
from __future__ import annotations

import torch

from memopt.compose import materialize_params, model_on_meta
from memopt.engines.base import PrecisionEngine, gather_over_ep, model_backward, model_forward, rank_key
from memopt.errors import ConfigError
from memopt.memory.hardware import host_memory_bytes
from memopt.models.moe import Expert
from memopt.optim.step import StepResult
from memopt.engines.chunk import defaults
from memopt.engines.chunk.chunk import DEVICE, HOST, shaped_view
from memopt.engines.chunk.comm import ChunkComm
from memopt.engines.chunk.hooks import ChunkHooks
from memopt.engines.chunk.hybrid_adam import ChunkAdam
from memopt.engines.chunk.manager import ChunkManager
from memopt.engines.chunk.tracer import MemTracer
from memopt.strategies.precision import Precision

GiB = 2**30


def device_capacity_bytes(cfg, device: torch.device) -> int:
    """``hardware.device_memory_gb``, or the device's memory (the host RAM for a CPU) when unset."""
    if cfg.hardware.device_memory_gb is not None:
        return int(cfg.hardware.device_memory_gb * GiB)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory_bytes()


DEFAULT_HOST_SHARE = 0.8  # PatrickStar's overall_cpu_mem_ratio (null: this, unless a plan decided the placement)
# overall_gpu_mem_ratio's null: PatrickStar's 0.8 kept a fifth of the device for what its sampled tracer
# missed; memopt's tracker counts every tensor, so 5% holds what none sees (CUDA context, NCCL buffers,
# fragmentation: 0.07 GiB over the tracker on an H100). On PatrickStar's node it is 1.3 more optimizer
# groups per V100 (the 28.2B plan of issue #29, docs/design.md).
DEFAULT_DEVICE_SHARE = 0.95
NAME, LABEL = "chunk", "the chunk engine"
SUPPORTS = ("chunk", "static_partition", "hybrid_adam", "fp16", "bf16", "ckpt", "act_offload", "flash_attn", "moe",
            "chunked_loss", "lora")
# chunks are partitioned over dp_shard (MoE experts over edp = dp_shard / ep: comm.py); the other dimensions must be 1
PARALLEL = ("dp_shard", "ep")


def build(cfg, device, dims, tracker) -> "ChunkEngine":
    return build_chunk_engine(cfg, device, dims, tracker, model_on_meta(cfg, device, dims, tracker), Precision.of(cfg))


def device_budget_bytes(cfg, device) -> int:
    """The device budget D: ``strategy.chunk.device_budget_gb``, or the capacity x ``overall_gpu_mem_ratio``
    (null: ``DEFAULT_DEVICE_SHARE``)."""
    ccfg = cfg.strategy.chunk
    if ccfg.device_budget_gb:
        return int(ccfg.device_budget_gb * GiB)
    share = DEFAULT_DEVICE_SHARE if ccfg.overall_gpu_mem_ratio is None else ccfg.overall_gpu_mem_ratio
    return int(device_capacity_bytes(cfg, device) * share)


def build_chunk_engine(cfg, device, dims, tracker, model, precision: Precision) -> "ChunkEngine":
    s = cfg.strategy
    ccfg = s.chunk
    budget = device_budget_bytes(cfg, device)

    named, experts = distinct_params(model)
    reuse = grad_reuse(cfg)
    world = dims.dp_shard.size if dims.dp_shard.enabled else 1
    # the options left to the engine (null), chosen before anything is allocated (defaults.py)
    payload, gf = precision.param_dtype.itemsize, 1 if reuse else 2
    chunk_size = resolve_chunk_size(ccfg, named, experts, world, payload, gf, budget, expert_world(dims))
    chunk_bytes = chunk_size * payload
    mem_saving = defaults.comm_form(ccfg, world, budget, chunk_bytes, gf)
    unit = world if world > 1 and not mem_saving else 1
    largest = max((p.numel() for _, p, _, _ in named), default=0)
    warmup = int(budget * defaults.warmup_share(ccfg, budget, unit, chunk_bytes, gf,
                                                defaults.chunk_size_fix(budget, unit, payload, gf, largest)))
    materialize_params(model, device, precision.param_dtype)
    named = [(name, model.get_parameter(name), shape, aliases) for name, _, shape, aliases in named]

    tracer = MemTracer(device, tracker, async_monitor=ccfg.async_mem_monitor, interval_ms=ccfg.monitor_interval_ms)
    mgr = ChunkManager(device, tracker, precision.param_dtype, chunk_size, budget, warmup, s.static_partition is not None, tracer,
                       reuse=reuse)
    if dims.dp_shard.enabled:
        mgr.comm = ChunkComm(dims.dp_shard, mem_saving, ccfg.mem_cache, tracker, expert_dim(dims))
    else:
        idle = [n for n in ("mem_saving_comm", "release_after_init", "res_check") if getattr(ccfg, n)]
        if idle:
            import warnings

            warnings.warn(f"strategy.chunk.{', '.join(idle)} only act with 2+ ranks (no remote chunks on one rank): "
                          "set trainer.nproc_per_node or run under torchrun", stacklevel=2)
    tracer._chunk_bytes = lambda: mgr.device_bytes + mgr.os_device_bytes
    try:
        mgr.pack(named, {id(p) for n, p, _, _ in named if n in experts})
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_host_budget(cfg, mgr)
    check_device_groups(cfg, mgr, budget)
    init = lambda name, shape: model.init_tensor(name, shape, cfg.seed)  # noqa: E731
    init_chunks(mgr, init, tracker, everything=ccfg.release_after_init)
    if ccfg.res_check and mgr.comm is not None:
        check_init(mgr, init)
    hooks = ChunkHooks(model, mgr)
    optimizer = ChunkAdam(mgr, cfg.optim, precision, dims.dp_shard, tracker, hybrid=s.hybrid_adam, margin_use_ratio=ccfg.margin_use_ratio,
                          cpu_impl=ccfg.cpu_adam_impl)
    return ChunkEngine(model, mgr, hooks, optimizer, precision, device, dims, tracker)


def expert_dim(dims):
    """The dimension expert chunks are partitioned over: ``edp`` with expert parallelism, else None (with the
    dense ones over dp_shard)."""
    return dims.edp if dims.ep.enabled else None


def expert_world(dims) -> int | None:
    """Ranks an expert chunk list is partitioned over (``expert_dim``'s size), None when it is dp_shard's."""
    dim = expert_dim(dims)
    return dim.size if dim is not None else None


def grad_reuse(cfg) -> bool:
    """Gradients are written over their parameters in the chunks (PatrickStar's reuse) when one
    micro-step makes them (``trainer.grad_accum`` == 1) and ``strategy.chunk.grad_reuse`` is on; with
    accumulation the next micro-step needs the parameters, so a gradient companion holds the sum."""
    return bool(cfg.strategy.chunk.grad_reuse) and cfg.trainer.grad_accum == 1


def distinct_params(model) -> tuple[list, set[str]]:
    """[[name, param, shape, aliases]] of the distinct parameters in registration order (tied ones keep
    their first name, the others are aliases) and the names of MoE expert parameters."""
    named, seen = [], {}
    for mod_name, mod in model.named_modules():
        for pname, p in mod._parameters.items():
            if p is None:
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            if id(p) in seen:
                seen[id(p)][3].append(full)
            else:
                seen[id(p)] = [full, p, tuple(p.shape), []]
                named.append(seen[id(p)])
    experts = {f"{mn}.{pn}" for mn, m in model.named_modules() if isinstance(m, Expert) for pn, _ in m.named_parameters()}
    return named, experts


def resolve_chunk_size(ccfg, named: list, experts: set[str], world: int, payload: int, grad_factor: int,
                       budget: int | None, expert_world: int | None = None) -> int:
    """``strategy.chunk.chunk_size`` (refused when a parameter does not fit), or the engine's choice from the
    world, the payload and the device budget (``defaults.chunk_size``; MoE experts get chunks of their
    own, so trainable dense, trainable expert and frozen tensors are three packing groups)."""
    def sizes(trainable: bool, expert: bool) -> list[tuple[str, int]]:
        return [(n, p.numel()) for n, p, _, _ in named if p.requires_grad == trainable and (n in experts) == expert]

    groups = [sizes(True, False), sizes(True, True), sizes(False, False)]
    return defaults.chunk_size(ccfg.chunk_size, groups, world, payload, grad_factor, budget, expert_world)


def check_host_budget(cfg, mgr: ChunkManager) -> None:
    """Refuse before any chunk is allocated (a refusal, not an out-of-memory) when this rank's packed
    chunks cannot fit the host budget: every parameter payload (and gradient companion) and every
    optimizer group not made on the device at build, against host RAM x ``overall_cpu_mem_ratio``
    (PatrickStar's reserve for host memory nothing accounts for; an explicit value wins). When it is null
    and the placement is decided
    (``strategy.hybrid_adam.device_groups`` set: a plan's decision, which plan mode, the preflight and
    the largest-model search make from a plan that counted the node's host exactly, every rank's chunks,
    temporaries and runtime included, against host RAM), the budget is the whole host RAM: the plan is
    the finer check, and the ratio would refuse what it fits (docs/design.md, "Hybrid Adam's placement")."""
    ccfg = cfg.strategy.chunk
    hybrid = cfg.strategy.hybrid_adam
    decided = hybrid is not None and hybrid.device_groups is not None
    ratio = ccfg.overall_cpu_mem_ratio or (1.0 if decided else DEFAULT_HOST_SHARE)
    host_budget = int((cfg.hardware.host_memory_gb * GiB if cfg.hardware.host_memory_gb else host_memory_bytes()) * ratio)
    owned = [c for c in mgr.trainable_chunks if c.tensors]
    on_device = min(len(owned), hybrid.device_groups or 0) if decided else 0  # made there at build
    host_need = sum(mgr.state_bytes(c) for c in mgr.local_chunks) + 12 * sum(c.numel for c in owned[on_device:])
    if host_need > host_budget:
        what = (f"host RAM x strategy.chunk.overall_cpu_mem_ratio={ratio}" if ccfg.overall_cpu_mem_ratio else
                f"host RAM: the placement is decided, strategy.hybrid_adam.device_groups={hybrid.device_groups}" if decided
                else f"host RAM x {DEFAULT_HOST_SHARE}, PatrickStar's strategy.chunk.overall_cpu_mem_ratio")
        raise ConfigError(
            f"chunk engine: this rank's chunks need up to {host_need / GiB:.2f} GiB on the host (params, grad companions if any, fp32 "
            f"master/momentum/variance{f' of the groups not made on the device at build' if on_device else ''}) but the host "
            f"budget is {host_budget / GiB:.2f} GiB ({what}); use more ranks, a smaller model or a larger hardware.host_memory_gb")


def check_device_groups(cfg, mgr: ChunkManager, budget: int) -> None:
    """Refuse, before any chunk is allocated, optimizer groups placed before step 0
    (``strategy.hybrid_adam.device_groups``) that alone exceed the device budget."""
    hybrid = cfg.strategy.hybrid_adam
    n = hybrid.device_groups if hybrid is not None else None
    if not n:
        return
    group = 12 * mgr.chunk_size  # fp32 master, momentum, variance of one chunk
    if n * group > budget:
        raise ConfigError(f"strategy.hybrid_adam.device_groups={n}: {n} optimizer groups of {group} B exceed the device "
                          f"budget of {budget} B by themselves; set at most {budget // group} (null: decided by the "
                          "warm-up step)")


def chunk_layout(cfg, model, dims, params: tuple | None = None) -> dict:
    """This rank's chunk layout of ``model`` (meta parameters), packed and assigned by the manager's own
    code without allocating anything, and the engine's host-budget refusal (``check_host_budget``): the
    planner checks that the shallow models it simulates have a layout that grows with depth the way the
    planned model's does, and packs the planned model first so that a refusal names its bytes.
    ``params``: ``distinct_params(model)`` when the caller has it already (the planner keeps it per depth)."""
    from memopt.memory.tracker import NullTracker

    ccfg = cfg.strategy.chunk
    named, experts = params if params is not None else distinct_params(model)
    cpu, null = torch.device("cpu"), NullTracker()
    world = dims.dp_shard.size if dims.dp_shard.enabled else 1
    size = resolve_chunk_size(ccfg, named, experts, world, Precision.of(cfg).param_dtype.itemsize, 1 if grad_reuse(cfg) else 2,
                              device_budget_bytes(cfg, cpu), expert_world(dims))
    mgr = ChunkManager(cpu, null, Precision.of(cfg).param_dtype, size, 0, 0, False, MemTracer(cpu, null), reuse=grad_reuse(cfg))
    if dims.dp_shard.enabled:  # the unit form does not change the layout's counts: no device budget needed to choose it
        mgr.comm = ChunkComm(dims.dp_shard, bool(ccfg.mem_saving_comm), ccfg.mem_cache, null, expert_dim(dims))
    mgr.pack(named, {id(p) for n, p, _, _ in named if n in experts})
    check_host_budget(cfg, mgr)
    local = mgr.local_chunks
    return {"chunk_size": size, "chunks": len(mgr.chunks), "local": sum(bool(c.tensors) for c in local),
            "local_padding": sum(not c.tensors for c in local),
            "optim_groups": sum(bool(c.tensors) for c in mgr.trainable_chunks)}


def init_chunks(mgr: ChunkManager, init, tracker, everything: bool) -> None:
    """Fill the chunks from the seed (every parameter is ``init(name, shape)``, whatever the rank).

    Each rank fills its own chunks. ``release_after_init`` (PatrickStar's option for a serial-equal
    init) allocates and fills every chunk, remote ones included, then frees the remote ones: the
    same result, at the cost of the whole model's bytes on the host during the build."""
    for c in mgr.chunks:
        if not (c.local or everything):
            continue
        c.allocate(HOST)  # zero-filled, padding included
        with tracker.category("temp"):
            for t in c.tensors:
                c.view_of(t).copy_(init(t.name, t.shape).reshape(-1))
    for c in mgr.chunks:
        if not c.local:
            c.release()


@torch.no_grad()
def check_init(mgr: ChunkManager, init) -> None:
    """``res_check``: gather every chunk from its owner and compare each parameter, bit for bit, with the
    serial (one-rank) initialisation; every rank raises, naming the parameters, if one differs."""
    bad = []
    mgr.phase = "io"
    for u in mgr.comm.units:
        mgr.gather([u], ("init", "res_check"))
        for t in u.tensors:
            want = init(t.name, t.shape).to(mgr.dtype).reshape(-1)
            if not torch.equal(t.chunk.view_of(t), want.to(t.chunk.data.device)):
                bad.append(t.name)
        mgr.comm.release(u)
    for u in list(mgr.comm.cache):
        mgr.comm.drop(u)
    mgr.comm.cache.clear()
    mgr.phase = "idle"
    everyone = [None] * mgr.comm.world
    torch.distributed.all_gather_object(everyone, bad, group=mgr.comm.group)
    wrong = sorted({n for b in everyone for n in b})
    if wrong:
        raise RuntimeError(f"strategy.chunk.res_check: the distributed initialisation differs from the serial one for "
                           f"{len(wrong)} parameter(s): {', '.join(wrong[:8])}")
    mgr.res_check_passed = True


class ChunkEngine(PrecisionEngine):
    def __init__(self, model, mgr: ChunkManager, hooks: ChunkHooks, optimizer: ChunkAdam, precision: Precision,
                 device, dims, tracker):
        self.model, self.mgr, self.hooks, self.optimizer, self.precision = model, mgr, hooks, optimizer, precision
        self.device, self.dims, self.tracker = device, dims, tracker
        self.history: list[dict] = []  # step_metrics() of every step (tests and reports read it)
        self.placement_margin = None  # device bytes Hybrid Adam could use, decided at the end of warm-up
        self.placement_hard_margin = None  # the most it can use (every chunk a moment does not need evicted)
        self._last: dict = {}

    def forward_backward(self, x, y, micro: int, n_micro: int) -> torch.Tensor:
        mgr = self.mgr
        mgr.begin_forward()
        mgr.phase = "fwd"
        try:
            loss = model_forward(self.model, self.precision, self.tracker, self.device, x, y)
            mgr.phase = "bwd"
            model_backward(self.model, loss, self.precision, self.tracker, n_micro)
        finally:
            mgr.phase = "idle"
        mgr.finish_backward()
        return loss.detach()

    def step(self, lr: float) -> StepResult:
        res = self.optimizer.step(lr)
        mgr = self.mgr
        if mgr.tracer.warmup:
            mgr.tracer.end_warmup()
            used = self._param_chunk_working_set()
            if mgr.static:
                used = min(used, mgr.warmup_budget)
            margin = mgr.device_budget - mgr.tracer.max_nonmodel - used
            hard = mgr.device_budget - mgr.hard_need()
            self.placement_margin, self.placement_hard_margin = margin, hard
            placed = self.optimizer.device_groups
            n = self.optimizer.place_on_device(margin, hard)
            if n < placed:  # the decision made before step 0 held more than the measured moments allow
                import warnings

                short = placed * self.optimizer.group_bytes - max(hard, 0)
                warnings.warn(f"strategy.hybrid_adam.device_groups={placed}: the warm-up measured a device margin of "
                              f"{hard} B (device budget {mgr.device_budget} B less its fullest moment with every other "
                              f"chunk evicted; non-model peak {mgr.tracer.max_nonmodel} B), {short} B short of those groups; "
                              f"{placed - n} moved back to the host (set device_groups={n} or leave it null)", stacklevel=2)
            mgr.make_room(mgr.device_budget - mgr.tracer.max_nonmodel - mgr.os_device_bytes if not mgr.static else mgr.warmup_budget)
        self._last = self._metrics(res)
        self.history.append(self._last)
        return res

    def _param_chunk_working_set(self) -> int:
        """Param/grad chunk bytes the device may have to hold at once: every chunk on one rank; with
        W ranks, this rank's own chunks plus the remote chunks of the units that can be gathered at
        once (the one computing, the next one, and the ``mem_cache`` queue)."""
        mgr = self.mgr
        own = sum(mgr.state_bytes(c) for c in mgr.local_chunks)
        if mgr.comm is None:
            return own
        per_unit = max((sum(mgr.state_bytes(c) for c in u.chunks if not c.local) for u in mgr.comm.units), default=0)
        remote = sum(mgr.state_bytes(c) for c in mgr.chunks if not c.local)
        return own + min(remote, (2 + mgr.comm.cache_size) * per_unit)

    def _metrics(self, res: StepResult) -> dict:
        mgr = self.mgr
        st = mgr.take_step_stats()
        return {
            "chunks_on_device": sum(c.where == DEVICE for c in mgr.chunks),
            "chunks_total": len(mgr.chunks),
            "mean_chunks_on_device": round(st["mean_chunks_on_device"], 3),
            "chunk_bytes_device": mgr.device_bytes + mgr.os_device_bytes,
            "chunk_bytes_host": sum(c.nbytes for c in mgr.chunks if c.where == HOST)
            + sum(o.nbytes for g in self.optimizer.groups for o in g[1:] if o.where == HOST),
            "chunk_peak_bytes_device": mgr.peak_device_bytes,
            "optim_chunks_on_device": self.optimizer.device_groups,
            "optim_chunks_at_start": self.optimizer.at_start,  # placed before step 0 (device_groups)
            "evictions": mgr.evictions,
            "fetches": mgr.fetches,
            "chunk_size": mgr.chunk_size,
            "device_budget_bytes": mgr.device_budget,
            "max_nonmodel_bytes": mgr.tracer.max_nonmodel,  # the warm-up's non-model peak on the device
            "placement_margin_bytes": self.placement_margin,
            "placement_hard_margin_bytes": self.placement_hard_margin,
            "optim_groups_device_max": self.optimizer.most,  # the most groups the measured moments allow there
            "warmup": mgr.tracer.warmup,
            **self._comm_metrics(),
        }

    def _comm_metrics(self) -> dict:
        comm = self.mgr.comm
        if comm is None:
            return {}
        st = comm.stats
        out = {"chunks_local": len(self.mgr.local_chunks), "padding_chunks": sum(not c.tensors for c in self.mgr.chunks),
               "comm_units": sum(bool(u.tensors) for u in comm.units), "gathers": st.gathers, "reduces": st.reduces,
               "comm_bytes": st.sent_bytes, "mem_cache_hits": st.cache_hits}
        if getattr(self.mgr, "res_check_passed", False):
            out["res_check"] = "passed"
        return out

    def step_metrics(self) -> dict:
        """Chunk placement after the last optimizer step (cumulative counters: evictions, fetches)."""
        return dict(self._last)

    @torch.no_grad()
    def eval_loss(self, x, y) -> float:
        self.model.eval()
        self.mgr.begin_forward()
        self.mgr.phase = "eval"
        try:
            with self.tracker.category("temp"), self.precision.autocast(self.device):
                loss = self.model(x, y)[1]  # the logits die here: nothing holds them through the backward
            return float(loss.float().item())
        finally:
            self.mgr.phase = "idle"
            self.mgr.settle(reduce=False)
            self.mgr.begin_forward()
            self.model.train()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights in fp32 on the host (a collective with 2+ ranks: every unit is gathered in turn; with
        expert parallelism the other ep ranks' experts are added, under their global names)."""
        values = {k: v.to("cpu", torch.float32, copy=True) for k, v in self._iter_chunk_state()}
        aliases = {n: info.name for info in self.mgr.infos.values() for n in info.aliases}
        state = {k: values[aliases.get(k, k)] for k in self.model.state_dict(keep_vars=True)}
        return gather_over_ep(state, self.model.param_dims(), self.dims)

    @torch.no_grad()
    def iter_full_state(self):
        """Each chunk tensor as a view of its payload (aliases once, under the tensor's name), a unit at
        a time: with 2+ ranks each unit is gathered, its tensors yielded, and released before the next;
        then the tensors outside the chunks (buffers). Expert parallelism assembles whole experts across
        ranks: the whole dict then (``full_state_dict``)."""
        if self.dims.ep.enabled:
            yield from self.full_state_dict().items()
            return
        yield from self._iter_chunk_state()

    def _iter_chunk_state(self):
        mgr = self.mgr
        view = lambda info: shaped_view(info.chunk.data, info)  # noqa: E731  (one view op, not narrow + view: a plan runs ~600)
        if mgr.comm is None:
            for info in mgr.infos.values():
                yield info.name, view(info)
        else:
            for u in mgr.comm.units:
                mgr.phase = "io"
                try:
                    mgr.gather([u], ("io", "state_dict"))
                finally:
                    mgr.phase = "idle"
                try:
                    for info in u.tensors:
                        yield info.name, view(info)
                finally:
                    mgr.phase = "io"
                    try:
                        mgr.comm.release(u)
                    finally:
                        mgr.phase = "idle"
        in_chunks = {n for info in mgr.infos.values() for n in [info.name, *info.aliases]}
        for k, v in self.model.state_dict(keep_vars=True).items():
            if k not in in_chunks:
                yield k, v.detach()

    # ---- resumable checkpoints ------------------------------------------------------------------
    @torch.no_grad()
    def checkpoint_model(self) -> dict[str, torch.Tensor]:
        """The weights of the chunks this rank owns (fp32 copies, aliases included) and the tensors
        outside the chunks: DCP writes each from its owner and ``merge`` reads their union, so a save
        holds 1/W of the model per rank, not the whole (``full_state_dict`` gathers every unit)."""
        out = {}
        for info in self.mgr.infos.values():
            if info.chunk.local:
                t = info.chunk.view_of(info).to("cpu", torch.float32, copy=True).view(info.shape)
                out.update({n: t for n in [info.name, *info.aliases]})
        in_chunks = {n for info in self.mgr.infos.values() for n in [info.name, *info.aliases]}
        for k, v in self.model.state_dict(keep_vars=True).items():
            if k not in in_chunks:
                out[k] = v.detach().to("cpu", torch.float32, copy=True)
        return out

    def checkpoint_model_to_load(self) -> dict[str, torch.Tensor]:
        return self.checkpoint_model()  # each rank reads back the same part it saved

    def checkpoint_state(self) -> dict:
        o = self.optimizer
        groups = {str(c.index): {"master": ms.data, "exp_avg": m.data, "exp_avg_sq": v.data} for c, ms, m, v in o.groups}
        return {rank_key(): {"step": o.step_count, "groups": groups, "scaler": self.scaler_state(),
                             "device_groups": o.device_groups}}

    @torch.no_grad()
    def load_checkpoint(self, model: dict[str, torch.Tensor], state: dict) -> None:
        for info in self.mgr.infos.values():  # the chunks this rank owns (checkpoint_model saved those)
            if info.chunk.local:
                info.chunk.view_of(info).copy_(model[info.name].reshape(-1))
        for name, buf in self.model.named_buffers():
            if name in model:
                buf.copy_(model[name])
        mine, o = state[rank_key()], self.optimizer
        for c, *opt in o.groups:
            saved = mine["groups"][str(c.index)]
            for chunk, key in zip(opt, ("master", "exp_avg", "exp_avg_sq")):
                if saved[key] is not chunk.data:
                    chunk.data.copy_(saved[key])
        o.step_count = int(mine["step"])
        self.load_scaler_state(mine["scaler"])
        # Hybrid Adam: the groups that were on the device go back there now, so the resumed run's first
        # step (a warm-up, before placement is decided again) updates them with the same kernel as the
        # uninterrupted run did (the device and host Adam kernels round differently)
        n = int(mine["device_groups"])
        for i, (_, *opt) in enumerate(o.groups):
            for chunk in opt:
                chunk.move(DEVICE if i < n else HOST)
        self.mgr.os_device_bytes = n * o.group_bytes
