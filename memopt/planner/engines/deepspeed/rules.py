"""``engine=deepspeed`` planned under DeepSpeed's own rules.

DeepSpeed's engine does not run on fake tensors (its ``module.to(device)`` cannot swap fake
parameters), so its model states and buffers are counted from the buffers its ZeRO optimizers
allocate for the config memopt translates (``engines/deepspeed.py``: bucket sizes, overlap,
offload), and the activations and temporaries come from the memopt engine's fake step of the same
model and strategies (DeepSpeed trains the same model code, so what autograd keeps is the same).

Per rank, P parameters, W data-parallel ranks, b bytes per parameter (2 for fp16 / bf16 weights, else
4; DeepSpeed accumulates gradients in the parameters' dtype by default), part = P / W:

  stage 0   params P b; grads P b (param.grad); optim 8 P (fp32: moments, the weights are the masters)
            or 12 P (bf16 weights: fp32 masters + moments); a flat copy of the gradients for the
            all-reduce (its 500M-element buckets hold any model this small whole). The all-reduce runs
            after the backward of the step's last micro-batch, so the total is the larger of the backward
            (compute bytes beside params, optim and every param.grad so far: accumulating, a later
            micro-batch's backward holds them all) and the end of the backward (every gradient and the
            flat copy, or the step: with bf16 weights DeepSpeed's unfused optimizer's fp32 copy of every
            gradient, 4 P, beside AdamW's foreach temporaries, 4 bytes x the larger optimizer group);
            adding them was 24% over
  stage 1/2 params P b (the flat low-precision copy); optim 12 part (fp32 master partition + moments;
            DeepSpeed clones the partition even in fp32); the reduction buckets, reduce_bucket_size
            elements x b, two with overlap_comm (allocated at every backward whatever the model size,
            so 2 x 25 MiB dominate a small model), and that once per communication dtype: under bf16
            autocast (torch_autocast) Linear parameters' gradients communicate in bf16 and the rest in
            fp32, each in buckets of their own (fp32 buffers, the parameters' dtype), so twice the
            buckets; the gradient partition: the parameters with elements in the rank's share, whole
            (``in_partition``). The total is the largest of the backward (its compute bytes; stage 1
            beside every param.grad so far, which it keeps to its reductions; stage 2's reductions in
            it at their moments, ``backward_reductions``), the reductions after it (``reductions``)
            and, without offload, the optimizer step, each beside the states and the data
  stage 3   params part b (host with offload_param); optim 12 part; the gradient partition part x b;
            one reduce bucket (one block's elements x b; under bf16 autocast a bf16 one too, x 2:
            stage 3's buckets are in their communication dtype); activations (the fake step runs
            DeepSpeed's own linear, ``linear.py``) + what DeepSpeed's coordinator holds
            gathered at their peak (W > 1: ``fetch.py`` replays its prefetch/release rules
            over the step's trace, recomputation included; flat buffers in the communication dtype).
            The total is the largest of the start of the backward (partitions and buffers, no block in
            flight, the parameters held after the forward, the compute peak of a one-rank memopt step,
            whose backward holds none of memopt's reduce-scatter scratch; with recomputation its bytes
            at the first gradient instead), each gradient's arrival up to the first reduce-scatter
            (what is held then, the one-rank step's compute bytes at that gradient, at the reduce the
            bucket's flat copy and gloo's scratch), each recomputation before that reduce (the most
            held from its first fetch to the next gradient, beside the one-rank step's compute peak
            from the recomputation to that gradient: the recomputed block's backward), each plus the
            data (the one-rank step's ``other``); and without offload the optimizer step (one group
            at a time: an fp32 copy of its gradient partition beside the foreach AdamW's temporaries,
            8 bytes x the larger group's partition; the peak of one-rank bf16 autocast)
  offload   optim and the fp32 gradient partition (4 part) on the host; stage 3 also the fp32
            masters' .grad buffers (4 part, allocated at initialize) beside the b x part partition;
            stage 1/2 also the host staging of the updated weights (part x b) and one gradient of the
            largest parameter on the host and on the device (largest x b each)

Stages 0-2: the ``params`` peak is at least the whole fp32 model (4 P), which every rank materialises
before DeepSpeed casts it. Stage 3 partitions each parameter as it is made, as ``deepspeed.zero.Init``
does (``engines/deepspeed_zero_init.py``): its ``params`` peak is the partitions beside one parameter
whole, and that build, with the parameter's fp32 draws and the data, is a moment of the total
(``_partitioned_as_made``).
On one rank the first reduce-scatter's flat copies are a moment too (d_model 256: 16,776,058 B measured). Not modelled: alignment padding (< 2 W elements per group),
``initialize`` (counted as ``other``; it ends at the states before the first step, (2 b + 12) part + block x b
+ the data, below the step by 8 x the larger group's part: gpt_tiny zero3 9,602,410 B on 2 ranks,
17,945,450 on 1, whose total peaks at the step), memopt's own gradient flat (one block, fp32 ``temp``) in the one-rank step's
compute peak, where DeepSpeed's is its reduce bucket (gpt_tiny zero3 + bf16 autocast, 2 ranks: the
compute peak a block later, 1.76% over). Measured, and what was fixed: tests/planner/test_accuracy_deepspeed.py.
engine=deepspeed with MoE: the expert
groups' states and DeepSpeed-MoE's own layer code on fake tensors (``moe_rules.py``). Which category
DeepSpeed's reduction buffers are counted under depends on when the tracker re-tags them
(``engines/deepspeed.py``): the plan puts them under ``grads``; a run splits them between ``grads``
and ``temp`` depending on the timing of its overlapped reductions, so the accuracy test compares
``params``, ``optim``, ``activations`` and the total per device.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import replace

from memopt.planner.engines.deepspeed.params import (autocast_bf16, block_numel, bucket_elements, comm_dtypes, largest_group,
                                                     largest_param, last_value, meta_params, param_bytes)
from memopt.planner.engines.deepspeed.reductions import (allreduce_bytes, arrival_order, backward_reductions, in_partition,
                                                         reduction_bytes, reductions, stage3_reduction_bytes)
from memopt.planner.engines.deepspeed.zero_step import offload_step_bytes, step_bytes


def deepspeed_model_states(cfg, world: int, params: int | None = None, rank: int | None = None) -> dict[str, dict[str, int]]:
    """{"device": {...}, "host": {...}} bytes of one rank's model states and DeepSpeed's buffers
    (``params``: the rank's parameters, when not the whole model's: DeepSpeed-MoE's local experts; ``rank``:
    stage 1/2's gradient partition is that rank's, ``in_partition``)."""
    from memopt import compose
    from memopt.strategies.precision import Precision
    from memopt.strategies.zero import selected_stage

    P, W, b = params or compose.num_params(cfg), max(1, world), param_bytes(cfg)
    part = math.ceil(P / W)
    _, stage, scfg = selected_stage(cfg)
    offload = cfg.strategy.cpu_offload is not None
    dev = {"params": 0, "grads": 0, "optim": 0}
    host = {"params": 0, "grads": 0, "optim": 0}
    opt_mem = host if offload else dev
    after = 0
    if stage == 0:
        dev["params"], dev["grads"] = P * b, 2 * P * b  # param.grad + the flat all-reduce copy
        dev["optim"] = 8 * P if Precision.of(cfg).param_dtype.itemsize == 4 else 12 * P
        # the all-reduce runs after the backward (the activations gone): its peak is every param.grad and the
        # flat copy beside params and optim; or the step: param.grad, (bf16 weights: DeepSpeed's unfused
        # optimizer's fp32 copy of every gradient) and the foreach AdamW's sqrt of the larger group's moments
        step = P * b + (4 * P if b == 2 else 0) + 4 * largest_group(cfg)
        after = P * b + dev["optim"] + max(2 * P * b, step)
    elif stage in (1, 2):
        bucket = bucket_elements(cfg)
        # per communication dtype (``comm_dtypes``), in the parameters' dtype whatever the communication dtype
        buffers = (2 if stage == 2 and scfg.overlap_comm else 1) * comm_dtypes(cfg)
        dev["params"] = P * b
        opt_mem["optim"] = 12 * part
        dev["grads"] = buffers * bucket * b
        if offload:
            host["grads"] = 4 * part  # the fp32 gradient partition the host Adam reads
            if stage == 2 and cfg.trainer.grad_accum > 1:  # accumulating: a host buffer per parameter of the
                host["grads"] += part * b  # partition, in its dtype (async_accumulate_grad_in_cpu_via_gpu)
            # the host staging (a b-byte copy of the partition for the updated weights, one gradient of the
            # largest parameter) and that gradient's device twin (temp_grad_buffer_for_{cpu,gpu}_offload)
            largest = largest_param(cfg)
            host["params"] = part * b
            host["grads"] += largest * b
            dev["grads"] += largest * b
        mine = in_partition(cfg, W, rank) if rank is not None and params is None else None
        gip = 0 if offload else part * b if mine is None else b * sum(n for i, (n, _, _) in enumerate(meta_params(cfg)) if i in mine)
        reduce = {**reductions(cfg, P, bucket, b, stage, gip=gip), "mine": mine}
        dev["grads"] += reduce["gip"]
        if not offload and cfg.strategy.moe is None:  # its step, one group at a time, the buckets let go at the
            # backward's end: the gradient partition, the group's fp32 copy of its share and the foreach AdamW's
            # sqrt of its moments (d_model 256, zero2, 2 ranks: 52,442,489 B measured, 3.5% under without)
            after = P * b + dev["optim"] + reduce["gip"] + 8 * math.ceil(largest_group(cfg) / W)
    else:
        block = block_numel(cfg)
        live = (2 if scfg.prefetch else 1) * block * b  # stage3_max_live_parameters
        offload_param = offload and cfg.strategy.cpu_offload.offload_param
        (host if offload_param else dev)["params"] = part * b
        dev["params"] += live
        opt_mem["optim"] = 12 * part
        # the reduce bucket, one per communication dtype in that dtype (stage3.py's ipg_buckets): under
        # torch_autocast a bf16 one beside the fp32 one (gpt_tiny, 2 ranks: grads 2,858,240 B measured)
        dev["grads"] = block * (b + (2 if comm_dtypes(cfg) > 1 else 0))
        (host if offload else dev)["grads"] += part * b  # grad_partitions_flat_buffer
        if offload:
            host["grads"] += 4 * part  # the fp32 master partitions' .grad buffers, allocated up front
    # stage 1/2: the partitions' reduced gradients are counted at their moments (``reductions``)
    in_total = sum(dev.values()) - (reduce["gip"] if stage in (1, 2) else 0)
    if stage == 0:  # in the backward: the compute bytes (deepspeed_sim adds them) beside params and optim
        in_total = dev["params"] + dev["optim"]
    if stage == 3 and not offload:  # its step, one optimizer group at a time: DeepSpeed's fp32 copy of the group's
        # gradient partition beside the foreach AdamW's temporaries, no parameter gathered (gpt_tiny, 1 rank: the peak)
        after = in_total - live + 8 * math.ceil(largest_group(cfg) / W)
    moments = {"held_after_forward": 0, "activations_held": 0, "grads": [], "recomputed": False, "recomputations": []}
    if stage == 3:  # what DeepSpeed's coordinator holds gathered (fetch.py) and its reduce bucket's
        # flat copy at the first reduce-scatter (on one rank nothing is gathered: a parameter's data is its
        # partition; the flat copy remains, and dominates a wide model's one-rank offload run, whose step is
        # on the host: d_model 256, 16,776,058 B measured, 15,061,917 planned before)
        from memopt.planner.engines.deepspeed.fetch import fetch_bytes, stage3_moments

        block = block_numel(cfg)
        # a fetch's flat buffers are in the communication dtype: bf16 for Linear weights under torch_autocast
        # (partition_parameters.py's get_allgather_dtype), the gathered parameters in their own
        ratio = [2 / b if safe and autocast_bf16(cfg) else 1 for _, _, safe in meta_params(cfg)]
        args = (W, (2 if scfg.prefetch else 1) * block, block if scfg.prefetch else 0, block, ratio)
        moments = last_value(_MOMENTS, repr((cfg, args)), lambda: stage3_moments(cfg, *args))
        g = b if W > 1 else 0  # bytes per gathered element
        fetched = fetch_bytes(moments["gathers"], moments["numel"], W, b, [round(b * r) for r in ratio])
        moments = {**moments, "fetch_bytes": max(1, cfg.trainer.grad_accum) * fetched,  # the step time's, a step's
                   "held_after_forward": round(g * moments["held_after_forward"]),
                   "activations_held": round(g * moments["activations_held"]),
                   "grads": [(round(g * held), round(b * flat)) for held, flat in moments["grads"]],
                   "recomputations": [round(g * held) for held in moments["recomputations"]]}
    if stage == 3:  # partitioned as made (engines/deepspeed_zero_init.py): the params peak is the partitions
        # beside one parameter whole (gathered blocks are counted where a run gathers them: activations, temp)
        offload_param = offload and cfg.strategy.cpu_offload.offload_param
        made = _partitioned_as_made(cfg, W, b, offload_param)
        dev["params"] = max(dev["params"] - live, made["device"])
        if offload_param:
            host["params"] = max(host["params"], made["host"])
        init = made["init"]
        if offload:  # initialize zeroes an fp32 gradient buffer of the (one) sub-group's partition on the host and
            # frees it: on a CPU-only machine that is the device, beside the device's partitions (d_model 256, one
            # rank, seq_len 16: 13,327,714 B measured, the peak); on a GPU it is below the host's training peak
            init_host_scratch = (0 if offload_param else part * b) + 4 * part
    else:  # memopt.compose materialises the whole fp32 model on every rank before DeepSpeed casts it, each
        # parameter's values drawn in fp32 and scaled (two copies of the largest)
        dev["params"] = max(dev["params"], 4 * P)
        init = 4 * compose.num_params(cfg) + 2 * 4 * largest_param(cfg)
    return {"device": dev, "host": host, "device_total": in_total, "init": init, **moments,
            "init_host_scratch": init_host_scratch if stage == 3 and offload else 0,
            "live_gathered": live if stage == 3 else 0, "after_backward": after,
            "reductions": reduce if stage in (1, 2) else None}


def _partitioned_as_made(cfg, W: int, b: int, on_host: bool) -> dict[str, int]:
    """Stage 3's build (``deepspeed_zero_init.partition_at_init``), parameter by parameter in the model's
    order: one made whole in b-byte elements on the device and filled from fp32 draws (two fp32 copies),
    then its partition (ceil(n / W) elements; on the host with ``on_host``) made beside it. Peaks of the
    ``params`` on each memory and of the device's total (the parameters and the draws)."""
    kept = 0  # partitions made so far
    out = {"device": 0, "host": 0, "init": 0}
    for n, _, _ in meta_params(cfg):  # distinct parameters, in the order the engine makes them
        part = math.ceil(n / W) * b
        on_dev = 0 if on_host else kept
        out["device"] = max(out["device"], on_dev + n * b + (0 if on_host else part))
        out["host"] = max(out["host"], kept + part if on_host else 0)
        out["init"] = max(out["init"], on_dev + n * b + max(8 * n, 0 if on_host else part))
        kept += part
    return out


# the last of each, shared by the ranks a plan simulates: the one-rank step, and stage 3's replayed moments
# (a forward and backward of the whole model on meta: 2.6 s for gpt_10b, once per simulated rank before)
_ONE_RANK: dict[str, dict] = {}
_MOMENTS: dict[str, dict] = {}


def _one_rank(mcfg, backend: str, depths: dict) -> dict:
    """memopt's step of ``mcfg`` on one rank: its compute bytes (a W-rank run's activations are the same)."""
    from memopt.planner.extrapolate import simulate

    def one() -> dict:
        with warnings.catch_warnings():  # "zero3 on one rank partitions nothing": true of this fake step, not of the
            warnings.filterwarnings("ignore", message=".*on one rank partitions nothing")  # W-rank run planned
            return simulate(mcfg, 0, 1, None, backend=backend, **depths)

    return last_value(_ONE_RANK, repr((mcfg, backend)), one)


def fake_step_cfg(mcfg):
    """The memopt config whose fake step gives a DeepSpeed stage-2 run's compute bytes: memopt's zero1.
    memopt's zero2 reduces each group from a flat temporary copy of its gradients (``temp``, at its
    backward's peak), where DeepSpeed reduces through its buckets (``reductions``); memopt's zero1 reduces
    in its gradient buffer (``grads``, not compute bytes)."""
    from memopt.strategies.zero import Zero1Config

    z = mcfg.strategy.zero2
    if z is None:
        return mcfg
    return replace(mcfg, strategy=replace(mcfg.strategy, zero2=None,
                                          zero1=Zero1Config(bucket_mb=z.bucket_mb, overlap_comm=z.overlap_comm)))


def deepspeed_traffic(cfg, world: int, rank: int, stage: int, sim: dict, states: dict, backend: str) -> dict:
    """The fake step's traffic with DeepSpeed's own bytes where the rules know them (the step time's memory
    term): stage 1/2's gradient handling in place of memopt's zero1's (``reduction_bytes``, the buckets filled in
    the step's gradient arrivals), stage 0's all-reduce in place of memopt's DDP's (``allreduce_bytes``), stage 3's
    reduce-scatters in place of memopt's zero3's (``stage3_reduction_bytes``) and its parameter fetches
    (``fetch.fetch_bytes``: memopt's all-gather writes in place, DeepSpeed's copies), and DeepSpeed's optimizer
    step in place of memopt's fused one (``zero_step.step_bytes``; with offload, stage 3's device-side ops,
    ``offload_step_bytes``: the host Adam has a term of its own)."""
    traffic = dict(sim["traffic"])
    order = arrival_order(cfg, sim.get("grad_arrivals") or [], world)
    ds = None
    if stage < 3:
        ds = sum((reduction_bytes(cfg, world, rank, order) if stage else allreduce_bytes(cfg, world)).values())
    elif stage == 3 and cfg.strategy.moe is None:
        ds = stage3_reduction_bytes(cfg, world, order, gloo=backend == "gloo")
    if ds is not None:
        traffic["op_bytes"] = traffic.get("op_bytes", 0) - traffic.get("grad_op_bytes", 0) + ds
        traffic["grad_op_bytes"] = ds
    if states.get("fetch_bytes"):
        traffic["op_bytes"] = traffic.get("op_bytes", 0) + states["fetch_bytes"]
        traffic["fetch_op_bytes"] = states["fetch_bytes"]
    step = step_bytes(cfg, world) if cfg.strategy.cpu_offload is None else offload_step_bytes(cfg, world)
    if step is not None:
        traffic["op_bytes"] = traffic.get("op_bytes", 0) - traffic.get("step_op_bytes", 0) + step
        traffic["step_op_bytes"] = step
    return traffic


def deepspeed_sim(cfg, rank: int, world: int, limits, backend: str, per_node: int, **depths) -> dict:
    """A simulate_rank-shaped result: activations/temp/other from memopt's fake step, model states and
    buffers from DeepSpeed's rules (the device total: the states + the fake step's non-model peak)."""
    from memopt.memory.tracker import CATEGORIES
    from memopt.planner.engines.deepspeed.linear import zero3_linear
    from memopt.planner.extrapolate import simulate
    from memopt.planner.simulate import ACTIVATIONS, PlanOverflow
    from memopt.strategies.zero import selected_stage

    stage = selected_stage(cfg)[1]
    moe = contextlib.nullcontext()
    if cfg.strategy.moe is not None:  # DeepSpeed-MoE: its expert groups' states and its own layer code
        from memopt.parallel.dims import resolve_sizes
        from memopt.planner.engines.deepspeed import moe_rules as deepspeed_moe_rules

        ep = resolve_sizes(cfg.parallel, world)["ep"]
        moe = deepspeed_moe_rules.deepspeed_moe_layers(ep)
        states = deepspeed_moe_rules.model_states(cfg, world, ep, param_bytes(cfg),
                                                  lambda p, w: deepspeed_model_states(cfg, w, p))
    else:
        states = deepspeed_model_states(cfg, world, rank=rank)
    # the fake step: memopt's own, zero1 for a stage-2 run (``fake_step_cfg``: memopt's zero2 holds its own
    # reduction's flat copies at its compute peak; DeepSpeed's are in ``reductions``)
    mcfg = fake_step_cfg(replace(cfg, engine=replace(cfg.engine, name="memopt")))
    # the fake step stops at its first op whose activations are over what the device leaves them: a DeepSpeed run
    # holds them on its device (the same model code: planned activations equal the measured ones), and the rules'
    # device total below holds them too: stages 0-2 beside every device state (the states + the backward's compute
    # bytes), stage 3 without recomputation at the backward's start (with it, the total takes the moments from the
    # first gradient on, not the forward's end: not stopped)
    where, cap = ("device", limits["device"]) if (limits or {}).get("device") is not None else ("all", (limits or {}).get("all"))
    held = states["device_total"] if stage < 3 else 0
    if cap is not None and held > cap:  # the states alone, before any micro-batch (``prune.plan_chain``)
        raise PlanOverflow(where, {"model states": held}, cap, at_build=True)
    stop = cap is not None and not (stage == 3 and getattr(cfg.strategy, "ckpt", None) is not None)
    try:
        with moe, zero3_linear(cfg):  # stage 3: DeepSpeed's own linear (linear.py)
            sim = simulate(mcfg, rank, world, {ACTIVATIONS: cap - held} if stop else None, backend=backend, **depths)
            # stage 3's compute bytes come from a one-rank step: memopt's own reduce-scatter scratch, which its
            # W-rank backward holds at its compute peak (gpt_tiny zero3 + cpu_offload, 2 ranks: 542,208 B), is
            # replaced by DeepSpeed's rules, and a one-rank step has none (the activations do not depend on W)
            one = sim if stage < 3 or world == 1 else _one_rank(mcfg, backend, depths)
    except PlanOverflow as e:  # the run's need at that op: its states (stages 0-2) and those activations
        if e.category != "activations" or not stop:
            raise
        raise PlanOverflow(where, {"model states": held, "activations": e.live["activations"]} if held else
                           {"activations": e.live["activations"]}, cap) from None
    data = sim.get("data", 0)  # the run's data and the model's buffers, held throughout
    peaks = {}
    for mem in ("device", "host"):
        measured = sim["peaks"].get(mem, {})
        cats = {c: 0 for c in CATEGORIES}
        if mem == "device":
            for c in ("activations", "temp", "other"):
                cats[c] = measured.get(c, 0)
            cats["activations"] += states.get("activations_held", 0)
        else:  # act_offload's checkpoint inputs: the same model-side code on both engines
            cats["activations"] = measured.get("activations", 0)
        for c, v in states[mem].items():
            cats[c] += v
        non_model = measured.get("total", 0) - sum(measured.get(c, 0) for c in ("params", "grads", "optim", "chunks", "comm"))
        cats["total"] = (states["device_total"] + max(0, non_model) if mem == "device"
                         else sum(states[mem].values()) + cats["activations"])
        if mem == "device" and stage < 3 and "device" in sim.get("backward_nonmodel", {}):
            # stages 0-2: the states beside the larger of the backward and what follows it, and the data. The
            # backward holds the model's compute bytes (activations, temp) of memopt's forward and backward, not
            # its non-model bytes at its own peak (its optimizer step's fp32 gradient temporaries: zero1 + fp16,
            # 1 rank, 4-10% over) nor its collectives' scratch; stages 0 and 1 also every gradient so far
            # (each param.grad kept: stage 1, d_model 256, 2 ranks, 5.4% under without), stage 2 a reduction in
            # the backward when a bucket fills before its end. After the backward: stage 0's all-reduce or step,
            # stage 1/2's last reductions (d_model 256, 2 ranks: zero1 15.8%, zero2 6.1% off before)
            backward = sim["backward_nonmodel"]["device"]
            after = states["after_backward"]
            red = states.get("reductions")
            if stage < 2:  # each param.grad is kept from its arrival to the all-reduce (stage 0) or the reductions
                # (stage 1) after the step's last micro-batch: accumulating, every later micro-batch's backward holds
                # them all (stage 0, moe_small bf16 DDP at 4 x 4, 2 ranks: its run crossed 1,724.0 MiB in its first
                # step, planned 1,545.7 without them)
                backward = max(backward, sim.get("backward_with_grads", {}).get("device", 0))
            if red is not None:
                if stage == 2:  # accumulating, the previous micro-batches' partition is kept (DeepSpeed's
                    # all_grad_tensors view it) while this one's reductions fill a new one, added into it at the
                    # epilogue
                    # (moe_small, zero2 at 8 x 2, 2 ranks: 161.3 MiB more than at 8 x 1, measured)
                    replayed = backward_reductions(cfg, sim.get("grad_arrivals") or [], red) if red["many"] else None
                    if replayed is not None:
                        backward = max(backward, replayed) + red["kept"]
                    else:
                        backward += red["kept"] + (red["gip"] + red["flat"] if red["many"] else 0)
                after = max(after, states["device_total"] + red["flat"] + (red["gip"] if red["many"] else 0) + red["kept"])
            cats["total"] = max(states["device_total"] + backward, after) + data
        if mem == "device" and stage == 3 and "device" in one.get("backward_nonmodel", {}):
            # stage 3 peaks when the backward starts: the partitions and buffers, no block in flight, what
            # DeepSpeed's coordinator still holds gathered, every activation beside the loss's gradient
            # (the compute peak of the forward and backward) and the run's data (``other`` of the one-rank
            # step, without memopt's collectives' scratch)
            # (with recomputation that compute peak is later: memopt's own buffers then beside it, so the first
            # gradient's moment); or a gradient's arrival up to DeepSpeed's first reduce-scatter: what is held
            # then, the one-rank step's compute bytes at that gradient and, at the reduce, the bucket's flat
            # copy (and gloo's input-sized scratch); or (no offload) its optimizer step
            ready = one.get("grad_ready_nonmodel") or [one["backward_nonmodel"]["device"]]  # (none: the compute peak)
            start = states["held_after_forward"] + (ready[0] if states["recomputed"] else one["backward_nonmodel"]["device"])
            grads = [held + ready[j] + flat * (2 if backend == "gloo" else 1)
                     for j, (held, flat) in enumerate(states["grads"][:len(ready)])]
            # or a recomputation before that reduce, up to the next gradient (the recomputed block's backward)
            grads += [held + compute for held, compute in zip(states["recomputations"], one.get("recompute_nonmodel", []))]
            data = one["peaks"]["device"].get("other", 0)
            cats["total"] = max(states["device_total"] - states["live_gathered"] + max([start, *grads]) + data,
                                states["after_backward"] + data, states.get("init", 0) + data,
                                (states["init_host_scratch"] + data) if backend == "gloo" else 0)
        if cats["total"]:
            peaks[mem] = cats
    sim["peaks"] = peaks
    sim["traffic"] = deepspeed_traffic(cfg, world, rank, stage, sim, states, backend)  # DeepSpeed's bytes in place of the fake step's
    sim["rules"] = "DeepSpeed's buffers for the translated config (model states) + memopt fake step (activations, temp)"
    return sim
