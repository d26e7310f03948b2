"""``+strategy=auto``: every candidate composition planned, the fastest predicted one that fits wins.

Axes (``strategy.auto``): precision x checkpointing x ZeRO stage x optimizer offload, the chunk engine
(Hybrid Adam) at each device budget, and micro-batch sizes (gradient accumulation scaled so the
global batch stays the same). Each candidate is planned by the planner (the run's code on fake
tensors); one that goes over a limit stops at that op, so hopeless candidates cost little. On a
CPU-only machine only fp32 is searched: without bf16/fp16 matrix units their matmuls are emulated
(hundreds of times slower), which the profile's peak FLOP/s cannot express. MoE itself is the user's
choice (it changes the model), but when it is selected the expert-parallel size ``parallel.ep`` is
searched (every size that divides both the data-parallel ranks and the experts, or
``strategy.auto.ep``): it changes where the expert parameters, gradients and optimizer states live
and adds the all-to-all buffers. ep > 1 is combined with every composition but cpu_offload (the fused
host step handles one data-parallel dimension); the chunk engine keeps the experts' chunks on their ep
ranks. Tensor parallelism is
searched (``strategy.auto.tp``) when the world has more than one rank and MoE is off: ``parallel.tp``
among the divisors of the world size that the model's shape allows, with and without sequence
parallelism and the vocabulary-parallel loss, times the ZeRO stages over the remaining data-parallel
ranks (no offload, no chunk engine: tp refuses them). Its plans count the tp collectives and each
rank's share of the FLOPs, so tp competes on the same step-time estimate; its ranks share their
micro-batches, so tp x the accumulation keeps the global batch. Every candidate then names its
``parallel.tp`` (1 for the others). Pipeline parallelism is searched likewise (``strategy.auto.pp``,
``pp_schedule``; ``planner/search_pp.py``): ``parallel.pp`` among the sizes dividing the world and the
blocks, each valid schedule, pp x the accumulation, ddp over the ranks left; each candidate's plan
holds its stages' peaks and its schedule's bubble, so it competes on the same fit and step time.
On one rank a candidate carries a ZeRO stage only to offload (``one_rank_offload_stages``) or where the engine
has no plain data parallelism (FSDP2: ``fully_shard`` of one rank, zero2 and zero3, which frees the whole weights
after each use).
"""
from __future__ import annotations

import copy
import math
import os
import warnings

from memopt.planner.candidate import BATCH, Candidate, carried, clear
from memopt.memory.hardware import peak_tflops_for
from memopt.planner.plan import SlowerThan, fit_bytes, fit_peaks, limits_of, step_time
from memopt.planner.placement import plan_placed
from memopt.planner.model_work import lower_bound_s, model_work, step_of, work_key
from memopt.planner.prune import MARGIN, bound_row, bounded, chains, plan_chain, work_class
from memopt.planner.simulate import PlanOverflow
from memopt.parallel.dims import expected_world
from memopt.strategies.precision import Precision
from memopt.strategies.tp import tp_sizes

PRECISION = {"fp32": (), "bf16": ("bf16",), "fp16": ("fp16",)}
CHUNK_PRESET = {"fp16": "hybrid_adam", "bf16": "hybrid_adam_bf16"}
CHUNK_FAMILY = ("chunk", "hybrid_adam", "hybrid_adam_bf16", "hybrid_adam_fp32", "static_partition")
CKPT = {"none": ((), ()), "full": (("ckpt",), ()), "every_k": (("ckpt",), (("strategy.ckpt.policy", "every_k"),)),
        "selective": (("ckpt",), (("strategy.ckpt.policy", "selective"),))}
SEARCHED = ("ep", "tp", "pp")  # the parallel sizes the search chooses: a candidate names its own


def ep_sizes(cfg) -> list[int]:
    """Expert-parallel sizes to search: ``strategy.auto.ep``, or every size dividing both the
    data-parallel shard ranks and the number of experts ([1] without MoE)."""
    from memopt.parallel.dims import expected_world

    moe = cfg.strategy.moe
    if moe is None:
        return [1]
    p = cfg.parallel
    world = expected_world(cfg)
    shard = p.dp_shard if p.dp_shard > 0 else world // max(1, p.dp_replicate * p.tp)
    valid = [e for e in range(1, shard + 1) if shard % e == 0 and moe.num_experts % e == 0]
    return [e for e in cfg.strategy.auto.ep if e in valid] if cfg.strategy.auto.ep else valid


def half_dtype(hw) -> str:
    """``strategy.auto.precision``'s ``half``: the 16-bit dtype the profile runs faster, fp16 where its peak is at
    least twice bf16's (a V100 has no bf16 units: 125 against 15.7 TFLOP/s, so every choice on PatrickStar's node
    was bf16 at the fp32 rate), else bf16. This CPU's own profile (``auto``) keeps bf16: its measured fp16
    products are converted or emulated, and which of two slow dtypes measures faster varies between CPUs."""
    from memopt.memory.hardware import peak_tflops_for

    if hw.name == "auto":
        return "bf16"
    fp16, bf16 = peak_tflops_for(hw, "fp16") or 0.0, peak_tflops_for(hw, "bf16") or 0.0
    return "fp16" if fp16 >= 2 * bf16 and fp16 > 0 else "bf16"


def check_engine_runs_kept(cfg) -> None:
    """Refuse a search whose engine cannot run what the command keeps in every candidate (MoE under FSDP2):
    it would have no candidate at all. Cheap: the gate calls it before measuring this CPU's rates."""
    supports = _engine_supports(cfg.engine.name)
    missing = sorted(set(carried(cfg).strategies) - supports) if supports is not None else []
    if missing:
        from memopt.errors import ConfigError

        able = [n for n in ("memopt", "deepspeed") if (s := _engine_supports(n)) is None or set(missing) <= s]
        raise ConfigError(f"engine={cfg.engine.name} +strategy=auto: the command's {', '.join(missing)} is not among "
                          f"what engine={cfg.engine.name} runs ({', '.join(sorted(supports))}), so it has no candidate; "
                          f"use {' or '.join(f'engine={n}' for n in able)}")


def candidates(cfg, hw) -> list[Candidate]:
    """The search's candidates for the command's typed ``cfg`` (composed on ``base_of(cfg)``)."""
    a, t = cfg.strategy.auto, cfg.trainer
    world = t.nproc_per_node * t.nnodes
    keep = carried(cfg)
    eps = ep_sizes(cfg)
    precisions = ["fp32"] if hw.device_is_host else list(dict.fromkeys(half_dtype(hw) if p == "half" else p
                                                                        for p in a.precision))
    global_mb = t.micro_batch_size * t.grad_accum
    # sizes that divide the global batch: another would train fewer samples a step (5 at 2 x 2 = 4), fewer FLOPs,
    # and win the ranking by not doing the same work
    mbs = list(a.micro_batch_size) or sorted({m for m in (max(1, t.micro_batch_size // d) for d in (1, 2, 4))
                                              if global_mb % m == 0}, reverse=True)
    stages = [s for s in a.stage if world > 1 or s == "ddp"] or ["ddp"]
    from memopt.engines import module_named

    engine = module_named(cfg.engine.name)
    supports = _engine_supports(cfg.engine.name)
    params_always_offloaded = getattr(engine, "OFFLOADS_PARAMS_ALWAYS", False)
    runs_here = getattr(engine, "offload_runs_here", None)
    offloads = [o for o in a.offload if not o or runs_here is None or runs_here(cfg)]  # FSDP2's on a CPU: none
    if world > 1:  # (stage, offload) in the search's order
        pairs = [(stage, off) for stage in stages for off in offloads]
    else:  # one rank: a stage only to offload (it partitions nothing), or where the engine has no plain one (FSDP2)
        plain = ["ddp"] if supports is None or "ddp" in supports else \
            [st for st in a.stage if st in ("zero2", "zero3") and st in supports]  # zero3 frees the whole weights
        pairs = [(st, off) for off in offloads
                 for st in (one_rank_offload_stages(a.stage, supports) if off else plain)]

    out = []
    for mb in mbs:
        batch = (("trainer.micro_batch_size", mb), ("trainer.grad_accum", max(1, global_mb // mb)))
        for ck in a.ckpt:
            ck_s, ck_o = CKPT[ck]
            for p in precisions:
                for ep in eps:
                    par = (("parallel.ep", ep),) if cfg.strategy.moe is not None else ()
                    for stage, off in pairs:
                        if off and ep > 1:  # refused: the fused host step handles one data-parallel dimension
                            continue
                        keep_stage = world > 1 or stage != "ddp"
                        names = (*PRECISION[p], *ck_s, *([stage] if keep_stage else []), *(["cpu_offload"] if off else []))
                        out.append(keep.extend(names, *ck_o, *par, *batch))
                        # optimizer offload alone, parameters on the device, where the engine has it (not FSDP2's)
                        if off and stage == "zero3" and world > 1 and not params_always_offloaded:
                            out.append(keep.extend(names, *ck_o, ("strategy.cpu_offload.offload_param", False), *par, *batch))
                    preset = CHUNK_PRESET.get(p, "chunk")  # fp32: the chunk engine alone (Adam on the host), no fp16 preset
                    for budget in a.chunk_budget_gb:
                        extra = (("strategy.chunk.device_budget_gb", budget),) if budget else ()
                        out.append(keep.extend((preset, *ck_s), *ck_o, *extra, *par, *batch))
    if supports is not None:  # engine=deepspeed / fsdp2: its own space (no chunk engine, its stages and options)
        out = [c for c in out if set(c.strategies) <= supports]
        check_engine_runs_kept(cfg)
    if world > 1 and supports is None:  # the pipeline engine is memopt's; pp_candidates reads its other rules
        from memopt.planner.search_pp import pp_candidates

        out += pp_candidates(cfg, precisions, mbs, global_mb, world, CKPT, PRECISION)
    tps = tp_sizes(cfg.model, world) if a.tp and world > 1 and cfg.strategy.moe is None else []
    if supports is not None and "tp" not in supports:
        tps = []
    if tps:
        out = [c.with_options(("parallel.tp", 1)) for c in out] + _tp_candidates(cfg, tps, precisions, mbs, global_mb, world)
    unique: list[Candidate] = []
    for c in out:
        if c not in unique:
            unique.append(c)
    return unique


def one_rank_offload_stages(searched, supports: set[str] | None) -> list[str]:
    """The ZeRO stages an offloading candidate takes on one rank, where no stage partitions anything: memopt's
    ``cpu_offload`` alone is ZeRO-Offload (no stage needed; ``supports`` None: the memopt engine), DeepSpeed's and
    FSDP2's need one of theirs (zero2 is DeepSpeed's single-GPU ZeRO-Offload); zero3 adds the parameters on the host
    (``offload_param``: the least a device can hold, DeepSpeed's ZeRO-Infinity on one GPU, memopt's zero3 likewise).
    Only stages the search was given and the engine implements."""
    able = [s for s in searched if supports is None or s in supports]
    first = "ddp" if supports is None else next((s for s in able if s in ("zero1", "zero2")), None)
    return [s for s in (first, "zero3") if s is not None and (s == "ddp" or s in able)]


def base_of(cfg):
    """The config every candidate of ``cfg``'s search is composed on: the command's, without its strategies
    and with the searched parallel sizes at their defaults."""
    return clear(cfg, SEARCHED)


def _tp_candidates(cfg, tps: list[int], precisions: list[str], mbs: list[int], global_mb: int, world: int) -> list[Candidate]:
    a = cfg.strategy.auto
    out = []
    for tp in tps:
        stages = list(a.stage) if world // tp > 1 else [None]  # one data-parallel rank: nothing to partition
        sps = [False, True] if cfg.model.seq_len % tp == 0 else [False]
        for mb in mbs:
            # tp ranks share their micro-batches: tp x the accumulation keeps the global batch of the others
            batch = (("trainer.micro_batch_size", mb), ("trainer.grad_accum", max(1, global_mb * tp // mb)))
            for ck in a.ckpt:
                ck_s, ck_o = CKPT[ck]
                for p in precisions:
                    for stage in stages:
                        for sp in sps:
                            for lp in (False, True):
                                names = (*PRECISION[p], *ck_s, "tp", *([stage] if stage else []))
                                out.append(Candidate(names, (*ck_o, *batch, ("parallel.tp", tp),
                                                             ("strategy.tp.sequence_parallel", sp),
                                                             ("strategy.tp.loss_parallel", lp))))
    return out


def _engine_supports(name: str) -> set[str] | None:
    """The strategies engine ``name`` implements (None: the memopt engine, which implements them all)."""
    from memopt.engines import module_named

    supports = getattr(module_named(name), "SUPPORTS", None)
    return None if supports is None else set(supports)


def plan_row(cand: Candidate, base, hw, limits: dict, slower_than: float | None = None) -> dict:
    """One candidate planned on ``base``, as its row of the ranked table (module level, picklable data in and
    out, so a worker process can plan it). A chunk candidate the engine refuses at a moment it names fixes for
    (warm-up budget) is planned again with them (the preflight's suggestion does the same): the row then
    carries them. ``candidate``: the typed candidate (with its fixes), ``overrides``: it printed.
    ``slower_than``: the step to beat when its chain was sent (in a worker, lowered by a fit found since: ``_LIVE``);
    a candidate whose first simulated rank is slower is not planned further (a bound row)."""
    from memopt.planner.preflight import plan_with_fixes

    live = _LIVE[0]  # in a worker: a fit another worker found meanwhile lowers the step to beat
    than = slower_than if live is None else (lambda: _lower(slower_than, live.value))
    plan, fixes, err = plan_with_fixes(cand, base, hw, limits, slower_than=than)
    cand = cand.with_options(*fixes)
    if isinstance(err, SlowerThan):  # the plan's step is its slowest rank's
        return bound_row(cand, err.step_s, err.than, f"rank {err.rank}'s own step, as planned")
    row = {"overrides": cand.overrides(), "candidate": cand, "fits": False}
    if plan is not None:
        fits = fit_bytes(plan)
        if plan["fits"] and "error" not in plan:
            row["plan"] = plan  # the chosen one's: plan mode and the preflight need not plan it again
        row.update(fits=plan["fits"] and "error" not in plan, step_s=plan.get("step_time", {}).get("total_s"),
                   peak=max(fits.values(), default=None), fit_bytes=fits,
                   dominant=plan.get("step_time", {}).get("dominant"), compute_s=plan.get("step_time", {}).get("compute_s"),
                   work=(plan["flops_per_step"], plan["traffic"].get("attention_flops", 0), plan["ranks_per_node"]))
    elif isinstance(err, PlanOverflow):
        row["why"] = err.reason or f"{err.device} over at {err.category}"
        row["at_build"] = err.at_build
    elif err is not None:
        row["why"] = f"refused: {str(err)[:80]}"
    return row


def _lower(sent: float | None, live: float) -> float | None:
    """The step to beat: the lower of the one the chain was sent with and the search's live one (None: neither)."""
    got = min(math.inf if sent is None else sent, live)
    return None if got == math.inf else got


_LIVE: list = [None]  # in a planning worker: the search's step to beat, shared (``search``), else None


def _worker_init(runtime: int, live) -> None:
    """A planning worker counts the runtime this process measured (its own resident set is not a rank's), and reads
    the step to beat as the search lowers it (``live``: a shared double, infinite until a candidate fits)."""
    from memopt.planner import plan

    plan._RUNTIME[:] = [runtime]
    _LIVE[0] = live


PARALLEL_FROM = 16  # candidates from which the search plans in worker processes (each starts in ~1 s: workers.py)


def search(cfg, hw, progress=None, workers: int | None = None, prune: bool = True) -> list[dict]:
    """Every candidate of the command's typed ``cfg`` planned, ranked: fitting ones by predicted step time,
    then the others. Each row: ``candidate`` (typed), ``overrides`` and ``label`` (it printed), ``fits``,
    ``step_s``, ``peak`` (the larger of its limits' bytes), ``fit_bytes`` ({"device"|"host": bytes}: per rank and
    per node: ``plan.fit_bytes``), ``dominant`` or ``why``; a fitting one its ``plan``.
    ``progress(done, total, row, best)``: called after each candidate (the CLI prints a line: a search of
    many candidates takes minutes, and said nothing until it ended). ``workers``: processes planning
    candidates side by side (default: the CPU count, at most 4; plans are independent and each is one
    process's CPU time), used from ``PARALLEL_FROM`` candidates on; unpruned, the rows are the same in any order.
    ``prune``: a composition's smaller micro-batches are not planned once a larger one fits, nor a candidate whose
    step's lower bound is slower than the best fitting step so far (``prune.py``: they cannot win; their rows say so;
    which ones a bound skips can depend on the order worker plans finish in, the winner cannot; the workers read
    the step to beat as it falls, so a plan sent before the first fit stops at a rank slower than it); with
    ``strategy.auto.trials=k``, slower than the k-th best, so that the k fastest predicted are all planned."""
    limits = limits_of(hw, cfg.trainer.nproc_per_node, cfg)
    base = base_of(cfg)
    rows, best = [], None
    ranked = max(1, cfg.strategy.auto.trials)  # the fastest that must be planned: the winner, or every trial's
    todo = candidates(cfg, hw)
    workers = workers or min(os.cpu_count() or 1, 4)

    def to_beat() -> float | None:
        """The ranked-th fastest fitting step so far: a candidate slower than it is none of the fastest ranked."""
        steps = sorted(r["step_s"] for r in rows if r["fits"] and r.get("step_s") is not None)
        return steps[ranked - 1] if len(steps) >= ranked else None

    def add(row: dict, i: int) -> None:
        nonlocal best
        row["_order"] = i  # the candidate's place in the list: ties rank as in a one-process search
        row["label"] = " ".join(row["overrides"])
        rows.append(row)
        if row["fits"] and row.get("step_s") is not None and (best is None or row["step_s"] < best["step_s"]):
            best = row
        if live is not None and prune and (over := to_beat()) is not None:
            live.value = over  # the plans in flight in the workers stop at a rank slower than it
        if progress is not None:
            progress(len(rows), len(todo), row, best)

    links = chains([c.without(*BATCH) for c in todo], [c.value(BATCH[0], 0) for c in todo],
                   [_every_size(c) for c in todo]) if prune else [[i] for i in range(len(todo))]
    cfgs = [c.config(base) for c in todo]
    classes = [work_class(c) for c in cfgs]
    dtypes = [Precision.of(c).name for c in cfgs]
    # likely fastest first, so that bounds stop the slow candidates early: the dtype of the highest peak, no recomputation
    links.sort(key=lambda c: (-(peak_tflops_for(hw, dtypes[c[0]]) or 0.0), classes[c[0]][0] != "None", min(c)))
    known: dict = {}  # work class -> the least (FLOPs, attention FLOPs, ranks per node) of its plans and model passes
    works: dict = {}  # model_work.work_key -> one micro-batch's model work (None: the pass failed; the plan will say)
    modelled = [_model_bounded(c) for c in cfgs]

    def compute_bound(i: int) -> float | None:
        if classes[i] not in known:
            return None
        flops, attention, local = known[classes[i]]
        compute = step_time(cfgs[i], hw, {"flops": flops, "traffic": {"attention_flops": attention}}, local)["compute_s"]
        return None if compute is None else compute * MARGIN

    def bound(i: int, above: float | None = None) -> float | None:
        """A lower bound of candidate ``i``'s planned step (``prune.py``): its class's known FLOPs at its own dtype's
        rates (less ``MARGIN``), and unless that alone is over ``above``, its model's own work, whose FLOPs then
        bound its class too; None while neither is known."""
        b = compute_bound(i)
        if (b is not None and above is not None and b > above) or not modelled[i]:
            return b
        key = work_key(cfgs[i])
        if key not in works:
            if pool is not None:  # made by a worker beside the plans: the chain waits for it (``next_chain``)
                raise _Pending(key, i)
            try:
                works[key] = model_work(cfgs[i])
            except Exception as e:  # noqa: BLE001 - only a bound: the candidate keeps its class's, its plan says what fails
                failed(key, i, e)
        if works[key] is None:
            return b
        local = min(expected_world(cfgs[i]), cfgs[i].trainer.nproc_per_node)
        step = step_of(cfgs[i], works[key])  # a lower bound of every count: of its class's FLOPs too
        if classes[i] not in known or step["flops"] < known[classes[i]][0]:
            known[classes[i]] = (step["flops"], step["traffic"].get("attention_flops", 0), local)
        model = lower_bound_s(cfgs[i], hw, step, local)
        return max((v for v in (b, model) if v is not None), default=None)

    def failed(key, i: int, e: Exception) -> None:
        works[key] = None
        warnings.warn(f"+strategy=auto: the model's own pass failed for {' '.join(todo[i].overrides())} "
                      f"({type(e).__name__}: {e}); its candidates are bounded by their class's compute alone")

    def take(chain: list[int], got: list[dict]) -> None:
        for i, row in zip(chain, got):
            work = row.pop("work", None)
            if work is not None and (classes[i] not in known or work[0] < known[classes[i]][0]):
                known[classes[i]] = work
            add(row, i)

    pool, running, passes, waiting = None, {}, {}, {}  # in worker processes: plans and model passes in flight,
    # and the chains waiting for a pass
    live = None  # with workers: the step to beat, shared with them (``_worker_init``)

    def next_chain() -> tuple[list[int], float | None] | None:
        """The next chain to plan and the step it must beat, its bounded tail given its rows first (None: no chain
        left). A chain whose bound needs a model pass not made yet waits for it; the pass is sent to a worker."""
        while links:
            chain = links.pop(0)
            over = to_beat() if prune else None
            try:
                k = bounded(chain, bound, over)
            except _Pending as p:
                waiting.setdefault(p.key, []).append(chain)
                if p.key not in passes.values():
                    passes[pool.submit(model_work, cfgs[p.i])] = p.key
                    if len(running) + len(passes) >= workers:  # every worker busy: nothing more to send now
                        return None
                continue
            for i in chain[k:]:
                add(bound_row(todo[i], bound(chain[k], over), over), i)
            if k:
                return chain[:k], over
        return None

    if workers > 1 and len(todo) >= PARALLEL_FROM:
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        from memopt.planner.plan import runtime_bytes
        from memopt.planner.workers import context as workers_context
        from memopt.planner.workers import in_callers_state

        ctx = workers_context()
        live = ctx.Value("d", math.inf)
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=in_callers_state(_worker_init),
                                 initargs=(runtime_bytes(), live)) as pool:
            while True:  # as many chains and passes as workers: each bound is read when its chain is sent
                while len(running) + len(passes) < workers and (got := next_chain()) is not None:
                    chain, over = got
                    running[pool.submit(plan_chain, [todo[i] for i in chain], plan_row, base, hw, limits, over)] = chain
                if not running and not passes:
                    break
                done, _ = wait([*running, *passes], return_when=FIRST_COMPLETED)
                for fut in done:
                    if fut in passes:  # the chains that waited for it go first again, in their order
                        key = passes.pop(fut)
                        try:
                            works[key] = fut.result()
                        except Exception as e:  # noqa: BLE001 - as in bound(): the class's compute bound stays
                            failed(key, waiting[key][0][0], e)
                        links[:0] = waiting.pop(key)
                    else:
                        take(running.pop(fut), fut.result())
    else:
        while (got := next_chain()) is not None:
            chain, over = got
            take(chain, plan_chain([todo[i] for i in chain], plan_row, base, hw, limits, over))
    rows.sort(key=lambda r: r.pop("_order"))
    fit = sorted((r for r in rows if r["fits"]), key=lambda r: (r["step_s"] is None, r["step_s"] or 0))
    return fit + [r for r in rows if not r["fits"]]


class _Pending(Exception):
    """A bound needs the model pass ``key`` (of candidate ``i``), which a worker makes."""

    def __init__(self, key, i: int):
        super().__init__(key)
        self.key, self.i = key, i


def _model_bounded(cfg) -> bool:
    """The candidate's model alone bounds its step (``model_work.py``): its engine's wing says so."""
    from memopt.planner.engines import wing

    w = wing(cfg)
    return w.model_bound is not None and bool(w.model_bound(cfg))


def _every_size(c: Candidate) -> bool:
    """A pipeline or a chunk-engine candidate: a smaller micro-batch can be faster there (``prune.py``)."""
    return c.value("parallel.pp", 1) != 1 or "pipeline" in c.strategies or any(n in CHUNK_FAMILY for n in c.strategies)


def ranked_table(rows: list[dict], top: int) -> str:
    smaller = sum(r.get("skipped") == "micro-batch" for r in rows)
    slower = sum(r.get("skipped") == "bound" for r in rows)
    why = [f"{smaller} as a larger micro-batch of their composition fits"] * bool(smaller) \
        + [f"{slower} as a lower bound of their step is slower than the fastest fitting step"] * bool(slower)
    lines = [f"memopt auto: {sum(r['fits'] for r in rows)} of {len(rows)} candidates fit"
             + (f" (not planned: {', '.join(why)})" if why else "") + "; fastest predicted first"]
    for i, r in enumerate(rows[:top]):
        if r["fits"]:
            speed = f"{r['step_s']:.3g} s/step ({r['dominant']})" if r["step_s"] is not None else "step time unknown"
            lines.append(f"  {i + 1:>2}. {speed}, {fit_peaks(r['fit_bytes'])}: {r['label']}")
        elif r.get("skipped"):
            lines.append(f"   -  skipped ({'a larger micro-batch of it fits' if r['skipped'] == 'micro-batch' else 'its step is slower'}): {r['label']}")
        else:
            why = r.get("why", "over a limit")
            lines.append(f"   -  does not fit ({why if len(why) <= 120 else why[:117] + '...'}): {r['label']}")
    return "\n".join(lines)


def largest_model(base: list[str], hw, lo: int = 1, hi: int = 512, field: str = "model.n_layer",
                  scan: int = 0) -> tuple[int, dict | None, list]:
    """The largest ``field`` (depth by default, width fixed by ``base``, the command's overrides: PatrickStar's
    and ZeRO-Offload's tables grow GPT models this way) whose plan fits ``hw``: by bisection, then the ``scan``
    values above the bisection's answer one by one. Bisection assumes fitting is monotone in depth, which holds for
    the memopt engine and DeepSpeed's rules but not for the chunk engine: its chunk size is searched per
    model and the last communication unit's chunks go to the first ranks, so a deeper model can need
    less host memory (PatrickStar's node, width 4096, Hybrid Adam: 60 fits, 61-65 do not, 66 does).
    Returns (value, its plan, [(value, fits, seconds)] tried); value lo - 1 when none fits."""
    import time

    from memopt.config import compose_config, to_dataclass, validate
    from memopt.errors import ConfigError
    from memopt.planner.candidate import set_field

    command = to_dataclass(compose_config(["trainer.mode=plan", *base]), ["trainer.mode=plan", *base])  # planned, not run here; typed once
    tried, best, best_plan = [], lo - 1, None

    def probe(n: int):
        t0 = time.perf_counter()
        cfg = copy.deepcopy(command)
        set_field(cfg, field, n)
        validate(cfg)
        try:
            plan = plan_placed(cfg, hw, limits_of(hw, cfg.trainer.nproc_per_node, cfg))  # as the run's preflight plans it
            ok = plan["fits"] and "error" not in plan
        except (PlanOverflow, ConfigError):  # over a limit, or refused by the engine at build (the chunk engine's host check)
            plan, ok = None, False
        tried.append((n, ok, time.perf_counter() - t0))
        return plan if ok else None

    top = hi
    while lo <= hi:
        mid = (lo + hi) // 2
        plan = probe(mid)
        if plan is not None:
            best, best_plan, lo = mid, plan, mid + 1
        else:
            hi = mid - 1
    for n in range(best + 1, min(top, best + scan) + 1):
        if any(v == n for v, _, _ in tried):  # bisected already: above ``best``, so it did not fit
            continue
        plan = probe(n)
        if plan is not None:
            best, best_plan = n, plan
    return best, best_plan, tried


def smallest_device_budget(rows: list[dict], hw, cfg) -> tuple[int, str] | None:
    """(device bytes, candidate label) of the least a candidate of ``cfg``'s search where none fits needs on the
    device: the frugal candidates (full checkpointing with optimizer offload, ZeRO-3's parameters offloaded
    too where it is searched, at the smallest micro-batch searched; a candidate stopped at its first op over
    the device, so its need is unknown) planned again without the device limit; where none of those can run
    (FSDP2's offload on a CPU), the other fully checkpointed candidates at that micro-batch. None when the search was
    not refused for the device (a CPU without a device budget: one memory) or no such candidate exists."""
    limits = limits_of(hw, cfg.trainer.nproc_per_node, cfg)
    if "device" not in limits or not rows:
        return None
    base = base_of(cfg)
    small = min(r["candidate"].value(BATCH[0], 0) for r in rows)
    checkpointed = [r for r in rows if r["candidate"].value(BATCH[0], 0) == small and not r.get("skipped")
                    and "ckpt" in r["candidate"].strategies and r["candidate"].value("strategy.ckpt.policy") is None]
    offloaded = [r for r in checkpointed if "cpu_offload" in r["candidate"].strategies
                 and r["candidate"].value("strategy.cpu_offload.offload_param") is not False]
    from memopt.planner.preflight import plan_with_fixes

    best = None
    # the offloading ones first; where none of them can run (FSDP2's offload on a CPU), the other checkpointed ones
    chosen = {id(r) for r in offloaded}
    rest = [r for r in checkpointed if id(r) not in chosen]
    rest = [r for r in rest if "zero3" in r["candidate"].strategies] or rest  # the most frugal stage, where searched
    for frugal in (offloaded, rest):
        for r in frugal:
            plan = plan_with_fixes(r["candidate"], base, hw, {k: v for k, v in limits.items() if k != "device"})[0]
            need = (plan or {}).get("fit", {}).get("device", {}).get("bytes")
            if need is not None and (plan.get("fit", {}).get("host") or {}).get("fits", True) and (best is None or need < best[0]):
                best = (need, r["label"])
        if best is not None:
            return best
    return best
