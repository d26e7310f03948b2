"""``ChunkEngine``: the training loop's interface over the chunk manager, hooks, tracer and optimizer.

``build_chunk_engine`` is called by ``compose.build`` when ``strategy.chunk`` is selected, after the
model was built on ``meta`` with flash attention / checkpointing applied and the precision resolved.
It packs the parameters into chunks (on the host), fills them from the seed with the same
per-parameter initialisation as every other engine, installs the hooks and builds the optimizer.

Life of a run: the first optimizer step (all its micro-steps) is the warm-up: chunks are limited to
W and the tracer records the trace. After it: budgets per moment (dynamic) or W (static), Belady
eviction, and with Hybrid Adam the optimizer groups the margin allows are moved to the device.
"""
from __future__ import annotations

import torch

from memopt.engines.base import Engine, category, retained
from memopt.memory.hardware import host_memory_bytes
from memopt.models.gpt import init_tensor
from memopt.optim import StepResult
from memopt.strategies.chunk.chunk import DEVICE, HOST
from memopt.strategies.chunk.hooks import ChunkHooks
from memopt.strategies.chunk.hybrid_adam import ChunkAdam
from memopt.strategies.chunk.manager import ChunkManager, ChunkOutOfMemoryError, search_chunk_size
from memopt.strategies.chunk.tracer import MemTracer
from memopt.strategies.precision import Precision

GiB = 2**30


def device_capacity_bytes(cfg, device: torch.device) -> int:
    """``hardware.device_memory_gb``, or the device's memory (the host RAM for a CPU) when unset."""
    if cfg.hardware.device_memory_gb is not None:
        return int(cfg.hardware.device_memory_gb * GiB)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory_bytes()


def build_chunk_engine(cfg, device, ctx, tracker, model, precision: Precision) -> "ChunkEngine":
    from memopt.compose import _materialize_params
    from memopt.errors import ConfigError

    s = cfg.strategy
    ccfg = s.chunk
    if ctx is not None and ctx.enabled:
        raise ConfigError(f"strategy chunk runs on one rank only for now (world size {ctx.world_size}): the distributed "
                          "chunk engine (all-gather / reduce-scatter of chunk groups) is not implemented; use "
                          "trainer.nproc_per_node=1, or +strategy=zero3 for several ranks")
    capacity = device_capacity_bytes(cfg, device)
    budget = int(ccfg.device_budget_gb * GiB) if ccfg.device_budget_gb else int(capacity * ccfg.overall_gpu_mem_ratio)
    warmup = int(budget * ccfg.warmup_gpu_chunk_mem_ratio)

    # distinct parameters in registration order; tied ones keep their first name
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
    chunk_size = ccfg.chunk_size or search_chunk_size(
        [[n.numel() for _, n, _, _ in named if n.requires_grad], [n.numel() for _, n, _, _ in named if not n.requires_grad]])
    _materialize_params(model, device, precision.param_dtype)
    named = [(name, model.get_parameter(name), shape, aliases) for name, _, shape, aliases in named]

    tracer = MemTracer(device, tracker, async_monitor=ccfg.async_mem_monitor, interval_ms=ccfg.monitor_interval_ms)
    mgr = ChunkManager(device, tracker, precision.param_dtype, chunk_size, budget, warmup, s.static_partition is not None, tracer)
    tracer._chunk_bytes = lambda: mgr.device_bytes + mgr.os_device_bytes
    try:
        mgr.pack(named)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    host_budget = int((cfg.hardware.host_memory_gb * GiB if cfg.hardware.host_memory_gb else host_memory_bytes())
                      * ccfg.overall_cpu_mem_ratio)
    n_train = sum(c.numel for c in mgr.trainable_chunks)
    host_need = sum(2 * c.payload_bytes if c.trainable else c.payload_bytes for c in mgr.chunks) + 12 * n_train
    if host_need > host_budget:
        raise ChunkOutOfMemoryError(
            f"chunk engine out of host memory at build: the chunks need up to {host_need / GiB:.2f} GiB on the host "
            f"(params, grads, fp32 master/momentum/variance) but the host budget is {host_budget / GiB:.2f} GiB "
            "(host RAM x strategy.chunk.overall_cpu_mem_ratio)")
    for c in mgr.chunks:
        c.allocate(HOST)  # zero-filled, padding included
        with category(tracker, "temp"):
            for t in c.tensors:
                c.view_of(t).copy_(init_tensor(t.name, t.shape, cfg.seed, cfg.model).reshape(-1))
    hooks = ChunkHooks(model, mgr)
    optimizer = ChunkAdam(mgr, cfg.optim, precision, tracker, hybrid=s.hybrid_adam, margin_use_ratio=ccfg.margin_use_ratio,
                          cpu_impl=ccfg.cpu_adam_impl)
    return ChunkEngine(model, mgr, hooks, optimizer, precision, device, ctx, tracker)


class ChunkEngine(Engine):
    def __init__(self, model, mgr: ChunkManager, hooks: ChunkHooks, optimizer: ChunkAdam, precision: Precision,
                 device, ctx, tracker):
        self.model, self.mgr, self.hooks, self.optimizer, self.precision = model, mgr, hooks, optimizer, precision
        self.device, self.ctx, self.tracker = device, ctx, tracker
        self.history: list[dict] = []  # step_metrics() of every step (tests and reports read it)
        self._last: dict = {}

    def forward_backward(self, x, y, micro: int, n_micro: int) -> torch.Tensor:
        mgr = self.mgr
        mgr.begin_forward()
        mgr.phase = "fwd"
        try:
            with retained(self.tracker), self.precision.autocast(self.device):
                _, loss = self.model(x, y)
            mgr.phase = "bwd"
            with category(self.tracker, "temp"):
                ((loss / n_micro) * self.precision.loss_scale).backward()
        finally:
            mgr.phase = "idle"
        mgr.finish_backward()
        return loss.detach()

    def step(self, lr: float) -> StepResult:
        res = self.optimizer.step(lr)
        mgr = self.mgr
        if mgr.tracer.warmup:
            mgr.tracer.end_warmup()
            used = sum(c.payload_bytes * (2 if c.trainable else 1) for c in mgr.chunks)
            if mgr.static:
                used = min(used, mgr.warmup_budget)
            margin = mgr.device_budget - mgr.tracer.max_nonmodel - used
            self.optimizer.place_on_device(margin)
            mgr.make_room(mgr.device_budget - mgr.tracer.max_nonmodel - mgr.os_device_bytes if not mgr.static else mgr.warmup_budget)
        self._last = self._metrics(res)
        self.history.append(self._last)
        return res

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
            "evictions": mgr.evictions,
            "fetches": mgr.fetches,
            "chunk_size": mgr.chunk_size,
            "device_budget_bytes": mgr.device_budget,
            "warmup": mgr.tracer.warmup,
        }

    def step_metrics(self) -> dict:
        """Chunk placement after the last optimizer step (cumulative counters: evictions, fetches)."""
        return dict(self._last)

    @torch.no_grad()
    def eval_loss(self, x, y) -> float:
        self.model.eval()
        self.mgr.phase = "eval"
        try:
            with category(self.tracker, "temp"), self.precision.autocast(self.device):
                _, loss = self.model(x, y)
            return float(loss.float().item())
        finally:
            self.mgr.phase = "idle"
            self.mgr.begin_forward()
            self.model.train()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        by_name = {}
        for info in self.mgr.infos.values():
            for n in [info.name, *info.aliases]:
                by_name[n] = info
        for k, v in self.model.state_dict(keep_vars=True).items():
            info = by_name.get(k)
            if info is None:
                out[k] = v.detach().float().cpu().clone()
            else:
                out[k] = info.chunk.view_of(info).detach().float().cpu().clone().view(info.shape)
        return out

    @property
    def loss_scale(self) -> float:
        return self.precision.loss_scale

    @property
    def skipped_steps(self) -> int:
        return self.precision.scaler.skipped_steps if self.precision.scaler is not None else 0

    @property
    def compute_dtype_name(self) -> str:
        return self.precision.name
