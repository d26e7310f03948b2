"""What DeepSpeed's ZeRO-3 still holds gathered when a forward returns (``engine=deepspeed`` plans).

memopt frees a block's gathered parameters after its forward; DeepSpeed's parameter coordinator
(``partitioned_param_coordinator.py``) does not always. From the second step on (the first records
the module trace) every module fetch also prefetches the next parameters of the recorded
forward + backward trace, up to ``stage3_prefetch_bucket_size`` elements and while fewer than
``stage3_max_live_parameters`` are gathered; a parameter the prefetcher passed over (already gathered)
is marked as used again at that later step and is then not released after its module's forward. So
when the forward ends the head and the first blocks of the backward stay gathered. A prefetch is one
coalesced all-gather into a flat buffer per communication dtype (each parameter's partition
``ceil(n / W)`` x ``W``); the
handle, and with it the flat buffer, lives until the last of its parameters has been waited for by
its own module, so a buffer shared by a forward parameter and a backward one survives the forward too.

This replays those rules over the model's module order (forward pre-hooks in call order; the
backward in reverse order of forward completion, parents before their children, as DeepSpeed's
pre-backward hooks fire) and returns the elements alive at the end of the forward: gathered
parameters + live flat buffers. Measured (gpt_tiny zero3 fp32, 2 ranks): 428,928 gathered elements
+ one 81,920-element buffer, the same as this replay. Not replayed: recomputation (checkpointing
fetches again in the backward), persistence thresholds above 0 and reuse distances above 0 (memopt's
translation sets both to 0), NVMe and hpZ.
"""
from __future__ import annotations

import math
from collections import deque


def module_trace(cfg) -> tuple[list[list[int]], list[int], list[tuple[str, int]]]:
    """From a forward of the model on the meta device: the fetch trace (per module fetch, in
    DeepSpeed's order, the indices of the module's own parameters), each parameter's numel, and the
    forward's events ("fetch", trace position) / ("release", trace position) in call order."""
    import torch

    from memopt.models import model_class

    with torch.device("meta"):
        model = model_class(cfg.model)(cfg.model)
    index, numel = {}, []
    for p in model.parameters():  # distinct parameters in DeepSpeed's ds_id order
        index[id(p)] = len(numel)
        numel.append(p.numel())
    own = {m: sorted(index[id(p)] for p in m.parameters(recurse=False)) for m in model.modules()}
    entered, exited, events, handles, pos = [], [], [], [], {}

    def enter(mod, _a):
        pos[mod] = len(entered)
        events.append(("fetch", len(entered)))
        entered.append(mod)

    def leave(mod, _a, _o):
        events.append(("release", pos[mod]))
        exited.append(mod)

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave))
    B, T = cfg.trainer.micro_batch_size, cfg.model.seq_len
    idx = torch.zeros(B, T, dtype=torch.long, device="meta")
    try:
        model(idx, idx)
    finally:
        for h in handles:
            h.remove()
    trace = [own[m] for m in entered] + [own[m] for m in reversed(exited)]
    return trace, numel, events


def held_after_forward(trace: list[list[int]], numel: list[int], events: list[tuple[str, int]], world: int,
                       max_live: int, prefetch: int, flat_ratio: list[float] | None = None) -> int:
    """Elements DeepSpeed's coordinator holds when the forward of a step with a complete trace ends
    (``flat_ratio``: per parameter, its communication dtype's size over its own, the flat buffers
    being in the communication dtype; 1 when not given)."""
    W = max(1, world)
    queue = deque((p, step) for step, ps in enumerate(trace) for p in ps)
    recent: dict[int, float] = {}
    status = ["none"] * len(numel)  # none | inflight | gathered
    registry: dict[int, int] = {}  # parameter -> handle
    handles: dict[int, list] = {}  # handle -> [flat elements, parameters not yet waited for by their module]
    live = [0]

    def gather(ps):
        ps = [p for p in ps if status[p] == "none"]
        if not ps:
            return
        live[0] += sum(numel[p] for p in ps)
        h = len(handles) + 1
        handles[h] = [sum(math.ceil(numel[p] / W) * W * (flat_ratio[p] if flat_ratio else 1) for p in ps), set(ps)]
        for p in ps:
            status[p], registry[p] = "inflight", h

    step = 0  # DeepSpeed's step id: fetches so far
    for kind, at in events:
        ps = trace[at]
        if kind == "release":  # post-forward: only what no later fetch has been recorded for
            for p in ps:
                if recent.get(p, -math.inf) <= step and status[p] == "gathered":
                    status[p] = "none"
                    live[0] -= numel[p]
            continue
        gather(ps)
        for p in ps:
            if p in registry:  # the wait completes every parameter of the handle
                h = registry.pop(p)
                for q in handles[h][1]:
                    status[q] = "gathered"
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
            gather(todo)
        step += 1
    flats = sum(h[0] for h in handles.values() if h[1])
    return sum(numel[p] for p in range(len(numel)) if status[p] == "gathered") + round(flats)
