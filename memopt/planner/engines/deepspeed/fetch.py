"""What DeepSpeed's ZeRO-3 holds gathered during a training step (``engine=deepspeed`` plans).

memopt frees a block's gathered parameters after its forward; DeepSpeed's parameter coordinator
(``partitioned_param_coordinator.py``) does not always. From the second step on (the first records
the module trace) every module fetch also prefetches the next parameters of the recorded trace, up
to ``stage3_prefetch_bucket_size`` elements and while fewer than ``stage3_max_live_parameters`` are
gathered; a parameter the prefetcher passed over (already gathered) is marked as used again at that
later step and is then not released after its module. A prefetch is one coalesced all-gather into a
flat buffer per communication dtype (each parameter's partition ``ceil(n / W)`` x ``W``; bf16 for
Linear weights under bf16 autocast); the handle, and with it the flat buffer, lives until the last of
its parameters has been waited for by its own module.

The trace is the one DeepSpeed records: a forward and backward of the composed model on the meta
device with hooks where DeepSpeed puts its own (fetch before a module's forward and, through an
autograd function on its outputs, before its backward; release after its forward and, through one
on its inputs, after its backward). With activation checkpointing the backward runs each checkpointed
block's forward again (fetches recorded and prefetched like any other), stopping at the last saved
tensor it needs. ``replay`` returns the elements gathered (parameters + live flat buffers) after each
event. Measured (gpt_tiny zero3 fp32, 2 ranks): at the end of the forward 428,928 gathered elements +
one 81,920-element buffer, the same as this replay. Not replayed: persistence thresholds above 0 and
reuse distances above 0 (memopt's translation sets both to 0), NVMe and hpZ.
"""
from __future__ import annotations

import math
from collections import deque


def module_trace(cfg) -> tuple[list[list[int]], list[int], list[tuple]]:
    """The fetch trace (per module fetch, in DeepSpeed's order, the indices of the module's own
    parameters), each parameter's numel, and the step's events in order: ("forward_fetch" (also a
    recomputation's) or "backward_fetch", trace position, module),
    ("release", parameters, module), ("grad", parameter, None) when its gradient is ready (DeepSpeed's
    reduce hook), ("forward_end", None, None); a module is its position in ``model.modules()``."""
    import torch

    from memopt.compose import model_on_meta
    from memopt.memory.tracker import NullTracker

    model = model_on_meta(cfg, torch.device("meta"), None, NullTracker())
    index, numel = {}, []
    for p in model.parameters():  # distinct parameters in DeepSpeed's ds_id order
        index[id(p)] = len(numel)
        numel.append(p.numel())
    own = {m: sorted(index[id(p)] for p in m.parameters(recurse=False)) for m in model.modules()}
    mid = {m: i for i, m in enumerate(model.modules())}
    trace, events, handles = [], [], []

    def fetch(mod, kind):
        events.append((kind, len(trace), mid[mod]))
        trace.append(own[mod])

    def each_tensor(x, f):
        if torch.is_tensor(x):
            return f(x)
        if isinstance(x, (tuple, list)):
            return type(x)(each_tensor(v, f) for v in x)
        return x

    class OnBackward(torch.autograd.Function):
        """Identity whose backward calls ``fn`` (DeepSpeed's hooks on a module's inputs and outputs)."""

        @staticmethod
        def forward(ctx, x, fn):
            ctx.fn = fn
            return x.detach()

        @staticmethod
        def backward(ctx, g):
            ctx.fn()
            return g, None

    def before_forward(mod, args):
        fetch(mod, "forward_fetch")
        mod._ds_grads_remaining = 0  # as DeepSpeed's post-backward counter: reset at every forward

        def after_backward():
            mod._ds_grads_remaining -= 1
            if mod._ds_grads_remaining == 0:
                events.append(("release", own[mod], mid[mod]))

        def wrap(x):
            mod._ds_grads_remaining += x.requires_grad
            return OnBackward.apply(x, after_backward)
        return each_tensor(args, wrap)

    def after_forward(mod, _args, out):
        events.append(("release", own[mod], mid[mod]))
        return each_tensor(out, lambda x: OnBackward.apply(x, lambda: fetch(mod, "backward_fetch")))

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(before_forward))
        handles.append(m.register_forward_hook(after_forward))
    for p in model.parameters():
        handles.append(p.register_post_accumulate_grad_hook(lambda q: events.append(("grad", index[id(q)], None))))
    B, T = cfg.trainer.micro_batch_size, cfg.model.seq_len
    idx = torch.zeros(B, T, dtype=torch.long, device="meta")
    try:
        loss = model(idx, idx)[1]
        events.append(("forward_end", None, None))
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    return trace, numel, events


def replay(trace: list[list[int]], numel: list[int], events: list[tuple], world: int, max_live: int,
           prefetch: int, flat_ratio: list[float] | None = None, gathers: list | None = None) -> list[tuple[float, float]]:
    """Elements DeepSpeed's coordinator holds gathered (parameters + live flat buffers) after each
    event of a step with a complete trace: (all, those gathered by a forward fetch: a run counts them as
    activations, in the forward or a recomputation; a backward fetch's are temporaries). ``flat_ratio``:
    per parameter, its communication dtype's size over its own (the flat buffers are in the
    communication dtype); 1 when not given. ``gathers``: appended each all-gather's parameters, in order."""
    W = max(1, world)
    ratio = flat_ratio or [1] * len(numel)
    queue = deque((p, step) for step, ps in enumerate(trace) for p in ps)
    recent: dict[int, float] = {}
    status = ["none"] * len(numel)  # none | inflight | gathered
    active: list[set] = [set() for _ in numel]  # modules between a parameter's fetch and their release
    registry: dict[int, int] = {}  # parameter -> handle
    handles: dict[int, list] = {}  # handle -> [flat elements, parameters not yet waited for by their module]
    live = [0]
    in_forward = [False] * len(numel)  # a parameter's gathered copy made by a forward fetch

    def gather(ps, forward):
        ps = [p for p in ps if status[p] == "none"]
        if not ps:
            return
        if gathers is not None:
            gathers.append(ps)
        live[0] += sum(numel[p] for p in ps)
        h = len(handles) + 1
        handles[h] = [sum(math.ceil(numel[p] / W) * W * ratio[p] for p in ps), set(ps), forward]
        for p in ps:
            status[p], registry[p] = "inflight", h

    step, held = 0, []  # DeepSpeed's step id: fetches so far
    for kind, at, mod in events:
        if kind == "release":  # only what no later fetch has been recorded for, and no other module uses
            for p in at:
                active[p].discard(mod)
                if recent.get(p, -math.inf) <= step and status[p] == "gathered" and not active[p]:
                    status[p] = "none"
                    live[0] -= numel[p]
        elif kind.endswith("fetch"):
            fw = kind == "forward_fetch"
            ps = trace[at]
            gather(ps, fw)
            for p in ps:
                active[p].add(mod)
                if p in registry:  # the wait completes (copies out) every parameter of the handle
                    h = registry.pop(p)
                    for q in handles[h][1]:
                        if status[q] != "gathered":
                            status[q], in_forward[q] = "gathered", fw
                    handles[h][1].discard(p)
            not_fetched = [p for p in ps if recent.get(p, -math.inf) < step]
            for _ in range(len(set(not_fetched))):
                if queue:
                    q, s = queue.popleft()
                    recent[q] = s
            if prefetch > 0:
                budget, todo, n = min(max_live - live[0], prefetch), [], 0
                while queue and n < budget:
                    q, s = queue.popleft()
                    if status[q] == "none" and q not in todo:
                        todo.append(q)
                        n += numel[q]
                    recent[q] = max(recent.get(q, -math.inf), s)
                gather(todo, fw)
            step += 1
        alive = [h for h in handles.values() if h[1]]
        gathered = [p for p in range(len(numel)) if status[p] == "gathered"]
        held.append((sum(numel[p] for p in gathered) + sum(h[0] for h in alive),
                     sum(numel[p] for p in gathered if in_forward[p]) + sum(h[0] for h in alive if h[2])))
    return held


def stage3_moments(cfg, world: int, max_live: int, prefetch: int, bucket: int,
                   flat_ratio: list[float] | None = None) -> dict:
    """The replayed elements at the moments stage 3's peak can be: the end of the forward (all held, and
    those counted as activations), the activations' peak (the end of the first recomputation when
    checkpointed blocks are recomputed, else the end of the forward), and each gradient's arrival up to
    the first reduce-scatter (DeepSpeed reduces a bucket when the next gradient would overflow it: the
    gathered elements then and, at that one, the bucket's flat copy: ``ceil(n / W) x W`` per gradient, in
    its communication dtype: ``flat_ratio`` as in ``replay``), and each recomputation up to that one: the
    most held from its first fetch to the next gradient's arrival (its block's backward), in order."""
    trace, numel, events = module_trace(cfg)
    ratio = flat_ratio or [1] * len(numel)
    gathers: list[list[int]] = []
    held = replay(trace, numel, events, world, max_live, prefetch, ratio, gathers)
    kinds = [e[0] for e in events]
    end = kinds.index("forward_end")
    act = end
    recompute = [k for k in range(end, len(events)) if kinds[k] == "forward_fetch"]
    if recompute and any(trace[events[k][1]] for k in recompute):  # blocks with parameters recomputed
        first_grad = next((k for k in range(recompute[0], len(events)) if kinds[k] == "grad"), len(events))
        act = max(k for k in recompute if k < first_grad)
    W, filled, grads = max(1, world), [], []
    for k, (kind, p, _) in enumerate(events):
        if kind != "grad":
            continue
        if sum(numel[q] for q in filled) + numel[p] > bucket and filled:
            grads.append((held[k][0], sum(math.ceil(numel[q] / W) * W * ratio[q] for q in filled)))
            break
        filled.append(p)
        grads.append((held[k][0], 0))
    arrivals = [k for k, e in enumerate(events) if e[0] == "grad"][:len(grads)]
    recomputations, k = [], end
    while True:  # a recomputation: forward fetches (and their releases) after the forward, until a backward event
        k = next((i for i in range(k + 1, len(events)) if kinds[i] == "forward_fetch"), None)
        arrival = next((a for a in arrivals if k is not None and a > k), None)
        if arrival is None:
            break
        recomputations.append(max(h for h, _ in held[k:arrival + 1]))
        k = next(i for i in range(k, len(events)) if kinds[i] in ("backward_fetch", "grad"))
    return {"held_after_forward": held[end][0], "activations_held": held[act][1], "grads": grads,
            "recomputed": act != end, "recomputations": recomputations, "gathers": gathers, "numel": numel}


def fetch_bytes(gathers: list[list[int]], numel: list[int], world: int, own: int, comm: list[int]) -> int:
    """Bytes one micro-batch's parameter fetches move through memory-bound ops (``partition_parameters.py``),
    counted by the planner's rule (``simulate.op_work``: an op's tensor arguments and outputs), from the replay's
    all-gathers (``gathers``); ``own``: bytes per element of the parameters, ``comm``: of each one's all-gather
    dtype. A parameter of n elements, s = ceil(n / W) a rank, is gathered into a flat buffer of W s (made:
    torch.empty, counted as written) after its shard is cast to the all-gather dtype where that differs (s (own +
    a)). Alone in its all-gather it is then a view of that buffer (cast back, n (a + own), where the dtypes
    differ); with others, every shard is concatenated into the buffer first (cat.out: 3 s a) and each parameter
    copied out of it after the wait (cat: 2 n a), then cast back where the dtypes differ. One rank gathers nothing."""
    if world <= 1:
        return 0
    total = 0
    for ps in gathers:
        for p in ps:
            n, a = numel[p], comm[p]
            s = math.ceil(n / world)
            cast = a != own
            total += world * s * a + (s * (own + a) + n * (a + own) if cast else 0)
            if len(ps) > 1:
                total += 3 * s * a + 2 * n * a
    return total
