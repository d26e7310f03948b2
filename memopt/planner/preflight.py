"""Preflight: plan a run before its ranks start and refuse it, in seconds, when it would not fit.

The plan stops at the first op of the simulated step that goes over a limit, so a model that is far
too big is refused after simulating a fraction of its initialisation. The suggestion is the first
composition whose simulation fits: the command's own, then it with checkpointing, then a short list
(ordered from the fastest to the most memory-frugal), each at the run's micro-batch and two smaller
ones (skipped when model states are the largest category over the limit: a smaller micro-batch holds
the same). When the engine refuses a moment and names its fixes (the chunk engine's warm-up budget:
``strategy.chunk.mem_saving_comm``, ``warmup_gpu_chunk_mem_ratio``), they are applied and the
composition planned again, so the suggestion is a command that runs. With several ranks the list
includes the pipeline (``parallel.pp`` sizes the blocks allow, 1F1B, the accumulation times pp so the
global batch stays), planned per stage like any run. A lower bound filters the list before any simulation: every composition keeps at least 14 bytes of
model states per parameter somewhere on the node (the chunk engine, whose gradients overwrite its 16-bit
parameters: 2 + 12 optimizer bytes; ZeRO's mixed precision 2 + 2 + 12; fp32 4 + 4 + 8), so when the node's device and host memory together
hold less than that, nothing is simulated and the refusal says how many parameters would fit.
"""
from __future__ import annotations

import math
import time
import warnings

from memopt.data import DataError
from memopt.errors import ConfigError
from memopt.planner.candidate import Candidate, carried, clear, kept, selection
from memopt.planner.plan import GiB, SlowerThan, fit_bytes, fit_peaks, fmt, fmt_params, limits_of, make_plan, runtime_bytes
from memopt.planner.placement import plan_placed
from memopt.planner.simulate import PlanOverflow, PlanUnsupported

# the least any composition holds: the chunk engine with gradients written over the fp16 parameter
# chunks, 2 + 12 (fp32 master, momentum, variance); ZeRO's mixed precision needs 16
STATE_BYTES_PER_PARAM = 14


class PreflightRefusal(ConfigError):
    """The plan does not fit: the message names the memory, the category, the numbers and a suggestion."""

    def __init__(self, message: str, plan: dict | None = None):
        super().__init__(message)
        self.plan = plan


def node_capacity(hw, ranks: int) -> float:
    """Bytes one node offers to model states (device + host, one RAM on a CPU-only machine), less the
    runtime of its ``ranks`` processes."""
    free_host = hw.host_memory_gb * GiB - ranks * runtime_bytes()
    return free_host if hw.device_is_host else hw.devices_per_node * hw.device_memory_gb * GiB + free_host


def trivially_fits(cfg, hw) -> bool:
    """True when a generous upper bound (32 B/param of model states on every rank, unsharded, plus
    Korthikanti et al.'s 34sbh + 5as^2b activation bytes per layer doubled for fp32, or the model's own
    count of a block's activations where larger (``Model.activation_bytes``), plus fp32 logits
    and their gradient, times 2) is under half of the smallest limit: then no simulation is needed."""
    from memopt import compose
    from memopt.models import model_class

    m, t = cfg.model, cfg.trainer
    s, b, h, a = m.seq_len, t.micro_batch_size, m.d_model, m.n_head
    # a model that counts its own block (the Llama: SwiGLU keeps more than a GPT MLP) raises the bound
    layer = max(2 * (34 * s * b * h + 5 * a * s * s * b), model_class(m).activation_bytes(m, b) or 0)
    act = m.n_layer * layer + 3 * 4 * s * b * m.vocab_size
    bound = 2 * (32 * compose.num_params(cfg) + act)
    return bound < 0.5 * min(limits_of(hw, t.nproc_per_node).values())


def engine_budget(cfg) -> bool:
    """The chunk engine with a device budget of its own (``strategy.chunk.device_budget_gb``): a limit the
    hardware bound of ``trivially_fits`` does not see, which the engine enforces at every traced moment."""
    from memopt.planner.engines import wing

    budget = wing(cfg).device_budget
    return budget is not None and budget(cfg) is not None


def preflight(cfg, hw) -> dict | None:
    """None when the run trivially fits, the plan when it fits; PreflightRefusal otherwise."""
    from memopt import compose

    if trivially_fits(cfg, hw) and not engine_budget(cfg):
        return None
    t0 = time.perf_counter()
    local = cfg.trainer.nproc_per_node
    what = f"{cfg.model.name} ({fmt_params(compose.num_params(cfg))} params) with {'+'.join(cfg.strategy.selected()) or 'no strategy'}"
    try:
        plan = plan_placed(cfg, hw, limits_of(hw, local, cfg))  # Hybrid Adam: its groups placed before step 0
    except PlanUnsupported as e:
        warnings.warn(f"preflight skipped: {e}", stacklevel=2)
        return None
    except PlanOverflow as e:
        where = "device+host RAM" if e.device == "all" else e.device
        msg = (f"preflight: {what} does not fit on hardware={hw.name}: " + (e.reason or
               f"rank 0 alone goes over its share of {where} ({fmt(e.limit)}) while {e.category} holds "
               f"{fmt(e.live[e.category])} (the largest category)"))
        raise PreflightRefusal(msg + "; " + suggest(cfg, hw) + _off(t0)) from None
    except DataError as e:  # the data cannot feed this run: no composition would change that
        raise PreflightRefusal(f"preflight: {e}" + _off(t0)) from None
    except ConfigError as e:  # the engine refuses the model at build (the chunk engine's host budget)
        raise PreflightRefusal(f"preflight: {what} is refused by the engine on hardware={hw.name}: {e}; "
                               + suggest(cfg, hw) + _off(t0)) from None
    if "error" in plan:  # the engine's own out-of-memory at a traced moment (the chunk engine's budget)
        raise PreflightRefusal(f"preflight: {what} is refused by the engine on hardware={hw.name}: {plan['error']}; "
                               + suggest(cfg, hw) + _off(t0), plan)
    if not plan["fits"]:
        o = plan["overflow"]
        msg = (f"preflight: {what} needs {fmt(plan['fit'][o['memory']]['bytes'])} of {o['memory']} memory, "
               f"{fmt(o['over_by'])} over {fmt(plan['fit'][o['memory']]['limit'])} (largest category {o['category']}: {fmt(o['bytes'])})")
        raise PreflightRefusal(msg + "; " + suggest(cfg, hw) + _off(t0), plan)
    return plan


def _off(t0: float) -> str:
    return f" (planned in {time.perf_counter() - t0:.1f} s; trainer.preflight=false skips this check)"


MODEL_STATES = ("params", "grads", "optim", "chunks")  # over with one of these largest: no smaller micro-batch is tried
CANDIDATES = (  # from the fastest to the most frugal; zero stages only with several ranks
    ["ckpt"], ["zero2"], ["zero2", "ckpt"], ["zero3", "ckpt"], ["cpu_offload", "ckpt"],
    ["zero3", "cpu_offload", "ckpt"], ["hybrid_adam", "ckpt"], ["hybrid_adam_bf16", "ckpt"],
)


def suggest(cfg, hw) -> str:
    """The first candidate composition whose simulation fits, or why none can (one sentence)."""
    return suggestion(cfg, hw)["text"]


def suggestion(cfg, hw) -> dict:
    """``suggest`` as a record (plan mode writes it into plan.json): ``overrides`` that replace the
    command's strategy selection and micro-batch (None when nothing fits), the candidate's predicted
    ``peak_bytes`` (the larger of its limits' bytes) and ``fit_bytes`` (device per rank, host per node),
    ``tried`` (candidates that did not fit) and the sentence ``text``."""
    from memopt import compose

    params = compose.num_params(cfg)
    nodes = max(1, cfg.trainer.nnodes)
    need = STATE_BYTES_PER_PARAM * params / nodes
    cap = node_capacity(hw, cfg.trainer.nproc_per_node)
    if need > cap:
        return {"overrides": None, "peak_bytes": None, "tried": [], "text": (
                f"no composition fits: model states alone need {STATE_BYTES_PER_PARAM} B/param on some memory of the node "
                f"({fmt(need)} per node) and hardware={hw.name} offers {fmt(cap)} (device + host) per node; at most "
                f"~{cap / STATE_BYTES_PER_PARAM / 1e9:.2f}B params fit before activations: use a smaller model or more "
                f"memory (more nodes: trainer.nnodes, or a larger hardware profile)")}
    base = clear(cfg, ("pp",))  # the command without its composition: each candidate brings its own
    world = cfg.trainer.nproc_per_node * nodes
    limits = limits_of(hw, cfg.trainer.nproc_per_node, cfg)
    tried = []
    for comp in _compositions(cfg, world):
        fixes: tuple = ()  # the engine's fixes found at one micro-batch hold at the smaller ones
        for mb in _micro_batches(cfg.trainer.micro_batch_size):
            plan, fixes, err = plan_with_fixes(comp.with_options(("trainer.micro_batch_size", mb)), base, hw, limits, fixes)
            chosen = comp.with_options(("trainer.micro_batch_size", mb), *fixes)
            if plan is not None and plan["fits"]:
                fits = fit_bytes(plan)
                return {"overrides": chosen.overrides(), "peak_bytes": max(fits.values()), "fit_bytes": fits,
                        "tried": tried, "text": f"this fits: {chosen.label()} (predicted {fit_peaks(fits)})"}
            tried.append(f"{chosen.without('trainer.micro_batch_size').label()} micro-batch {mb}")
            over = getattr(err, "category", None) if plan is None else (plan["overflow"] or {}).get("category")
            if over in MODEL_STATES:
                break  # a smaller micro-batch holds the same model states
    text = f"none of {len(tried)} candidate compositions fits (tried {', '.join(tried[:6])}{', ...' if len(tried) > 6 else ''})"
    need = _frugal_device_need(cfg, base, hw, limits, world) if "device" in limits else None
    if need is not None:
        text += (f"; a budget that works: {fmt(need[0])} on the device for {need[1]}, so hardware.device_memory_gb="
                 f"{math.ceil(need[0] / 2**30 * 1000) / 1000:.3f} or more")
    return {"overrides": None, "peak_bytes": None, "tried": tried, "text": text}


# the most frugal compositions first; the first the engine runs is planned (FSDP2 offloads on a CUDA device only,
# DeepSpeed offloads on one rank under a ZeRO stage)
FRUGAL = {True: (["zero3", "cpu_offload", "ckpt"], ["cpu_offload", "ckpt"], ["zero3", "ckpt"]),  # several ranks
          False: (["cpu_offload", "ckpt"], ["zero3", "cpu_offload", "ckpt"], ["zero3", "ckpt"], ["ckpt"])}


def _frugal_device_need(cfg, base, hw, limits: dict, world: int) -> tuple[int, str] | None:
    """(device bytes per rank, label) of the most frugal composition the engine runs (``FRUGAL``, at micro-batch 1)
    planned without the device's limit: the least a device budget must hold, for a refusal to name. None when
    none of them can be planned."""
    for names in FRUGAL[world > 1]:
        cand = carried(cfg).extend(names).with_options(("trainer.micro_batch_size", 1))
        plan = plan_with_fixes(cand, base, hw, {k: v for k, v in limits.items() if k != "device"})[0]
        need = ((plan or {}).get("fit") or {}).get("device", {}).get("bytes")
        if need and plan["fit"].get("host", {}).get("fits", True):
            return need, cand.label()
    return None


MAX_FIXES = 4


def plan_with_fixes(cand: Candidate, base, hw, limits, fixes: tuple = (),
                    slower_than=None) -> tuple[dict | None, tuple, Exception | None]:
    """(plan, the fixes applied, the last error): ``cand`` plus ``fixes`` ((field, value) pairs) planned on
    ``base``; when the engine refuses a moment and names fixes (the chunk engine's warm-up budget:
    ``ChunkOutOfMemoryError.fixes``), the first one not applied yet is added (replacing an earlier value of
    the same field) and the plan repeated, at most ``MAX_FIXES`` times. ``slower_than``: ``make_plan``'s (its
    ``SlowerThan`` is the error)."""
    from memopt.config import validate

    fixes = tuple(fixes)
    for _ in range(MAX_FIXES + 1):
        try:
            typed = cand.with_options(*fixes).config(base)
            validate(typed)
            return make_plan(typed, hw, limits, slower_than), fixes, None
        except (ConfigError, SlowerThan) as e:
            return None, fixes, e
        except PlanOverflow as e:
            new = next((tuple(f) for f in e.fixes if not set(f) <= set(fixes)), None)
            if new is None or len(fixes) >= MAX_FIXES:
                return None, fixes, e
            keys = {k for k, _ in new}
            fixes = (*[f for f in fixes if f[0] not in keys], *new)
    return None, fixes, None


def _compositions(cfg, world: int) -> list[Candidate]:
    """The compositions to try in order: the command's own (with checkpointing added when it has none), then
    ``CANDIDATES``, each keeping the strategies that change the model (MoE); ZeRO stages only with several
    ranks; with several ranks, the pipeline at each ``parallel.pp`` the run's blocks allow, without and with
    checkpointing (``search_pp.pp_compositions``), after the ZeRO-2 ones: it divides every model state
    by pp, as ZeRO-3 does, but sends one activation per micro-batch instead of gathering every layer."""
    from memopt.parallel.dims import ParallelConfig
    from memopt.planner.search_pp import pp_compositions

    keep = carried(cfg)
    own = selection(cfg)
    pp = (("parallel.pp", cfg.parallel.pp),) if cfg.parallel.pp != ParallelConfig().pp else ()  # belongs to a pipeline
    out = []
    if own and "auto" not in own:
        opts = (*kept(cfg, own), *pp)
        out.append(Candidate(own, opts))
        if "ckpt" not in own:
            out.append(Candidate((*own, "ckpt"), opts))
    pipeline = [keep.extend(c.strategies, *c.options) for c in (pp_compositions(cfg, world) if world > 1 else [])]
    for names in CANDIDATES:
        if names == ["zero3", "ckpt"]:
            out += [c for c in pipeline if c not in out]
        if (any(n.startswith("zero") for n in names) and world == 1) or \
                any(sorted((*keep.strategies, *names)) == sorted(c.strategies) for c in out):
            continue
        out.append(keep.extend(names))
    return out


def _micro_batches(mb: int) -> list[int]:
    out = [mb]
    while out[-1] > 1 and len(out) < 3:
        out.append(max(1, out[-1] // 4))
    return out
