"""ZeRO stage 1/2's gradient reductions under DeepSpeed's rules (stage_1_and_2.py, contiguous gradients): what
a reduction holds beside the states, each rank's gradient partition, the moments stage 2's reductions in the
backward hold most (replayed over the fake step's gradient arrivals), and the bytes its gradient handling moves
(the step time's memory term; stage 0's all-reduce too)."""
from __future__ import annotations

import math

from memopt.planner.engines.deepspeed.params import (autocast_bf16, bucket_elements, comm_dtypes, meta_params,
                                                     optimizer_groups, param_bytes, rank_params)


def reductions(cfg, P: int, bucket: int, b: int, stage: int, gip: int) -> dict:
    """Stage 1/2's reductions (stage_1_and_2.py, contiguous gradients): each gradient is copied into its
    communication dtype's bucket when reduced; a reduction flattens the bucket's gradients into a new tensor
    (cast to bf16 for torch_autocast's safe modules: one more copy), then copies this rank's share into the
    gradient partition (``gip``: allocated at the first reduction, then kept). Stage 2 reduces as a bucket
    fills; stage 1 keeps every param.grad to its reductions after the backward. ``flat``: what a reduction
    holds beside the states (stage 1: every gradient, in buckets, flattened or not, and the cast copy);
    ``many``: a bucket fills before the last reduction, which then holds ``gip`` too (``deepspeed_sim``)."""
    autocast = autocast_bf16(cfg)
    groups = [0, 0]  # elements per communication dtype: its own, and bf16 for torch_autocast's safe modules
    for n, _, safe in meta_params(cfg):
        groups[safe and autocast] += n
    scale = P / max(1, sum(groups))  # DeepSpeed-MoE passes the rank's own parameters
    first = [min(round(g * scale), bucket) for g in groups]  # elements of each dtype's first reduction
    cast = first[1] * 2
    flat = P * b + cast if stage == 1 else max(first[0] * b, first[1] * b + cast)
    # accumulating over micro-batches, what stage 2's second one holds beside its own reductions: the previous
    # gradient partition (each micro-batch's epilogue lets go of the buffer, not of the partition's gradients,
    # which it adds the next one's into); with offload it accumulates on the host instead. (Stage 1 keeps every
    # param.grad to the last micro-batch, as memopt's zero1 in the fake step: ``backward_with_grads``.)
    kept = gip if stage == 2 and cfg.trainer.grad_accum > 1 else 0
    return {"gip": gip, "flat": flat, "many": any(round(g * scale) > bucket for g in groups), "kept": kept,
            "bucket": bucket, "offload": cfg.strategy.cpu_offload is not None}


def in_partition(cfg, W: int, rank: int) -> dict[int, int]:
    """{index (the rank's parameters, ``rank_params``): its elements in ``rank``'s partition} of the parameters
    with elements there: DeepSpeed flattens each of the translation's optimizer groups (``ndim >= 2``, then the
    rest, each in the model's order; DeepSpeed-MoE's expert parameters in groups of their own) and gives the r-th
    rank of the group's data-parallel ranks its r-th share (an expert group: W / ep ranks, the rank's r = rank //
    ep). Its gradient partition holds these parameters whole (stage_1_and_2.py's ``grads_in_partition``: gpt_tiny
    d_model 256, 2 ranks: 6,646,784 and 7,367,680 B), made when the first of them is reduced."""
    params, out = rank_params(cfg, W), {}
    for members in optimizer_groups(params):
        G = params[members[0]][4]
        r = rank // max(1, W // G)
        part, start = math.ceil(sum(params[i][0] for i in members) / G), 0
        lo, hi = r * part, (r + 1) * part
        for i in members:
            n = params[i][0]
            if start < hi and start + n > lo:
                out[i] = min(hi, start + n) - max(lo, start)
            start += n
    return out


def arrival_order(cfg, arrivals: list, world: int = 1) -> list[int] | None:
    """The parameters' indices in the order of their first gradients (``grad_arrivals``), where they name each of
    the rank's parameters (``rank_params``) once; else None."""
    order = [i for i, _, _ in arrivals]
    return order if sorted(order) == list(range(len(rank_params(cfg, world)))) else None


def backward_reductions(cfg, arrivals: list, red: dict) -> int | None:
    """Stage 2's peak bytes outside the states over its reductions in the backward, replayed over the fake
    step's gradient arrivals (``grad_arrivals``: each parameter's index, the compute bytes then, their peak
    until the next). DeepSpeed reduces a communication dtype's bucket when the next gradient would overflow it
    (stage_1_and_2.py, ``reduce_independent_p_g_buckets_and_remove_grads``), holding the bucket's flat copy
    (and its bf16 cast) beside that moment's compute bytes; the gradient partition (``red["gip"]``) from the
    first reduction of a parameter in it (``red["mine"]``; None: any) on. With offload, the flat copy freed,
    each of its parameters' share of the partition is copied to fp64 for its norm (``set_norm_for_param_grad_in_gpu``:
    d_model 256, 1 MiB buckets, one rank: 31,671,169 B measured, 1.7% under without). Adding the last bucket's flat copy
    and the partition to the backward's compute peak instead was 6.7% over (gpt_small bf16 + ZeRO-2-Offload,
    1 rank: the first reduction comes a quarter of the way into the backward, its activations partly freed).
    None where the arrivals do not name each parameter once (a depth extrapolated from shallower steps whose
    blocks differ: ``extrapolate._whole_arrivals``) or with MoE (DeepSpeed-MoE's parameters are not memopt's):
    the rules then take the backward's compute peak."""
    params = meta_params(cfg)
    if cfg.strategy.moe is not None or arrival_order(cfg, arrivals) is None:
        return None
    autocast, b, gip, mine = autocast_bf16(cfg), param_bytes(cfg), red["gip"], red.get("mine")
    norm = 8 if red["offload"] else 0  # bytes per element of a norm's copy (get_norm_dtype: fp64)
    filled, held, peak = [0, 0], [[], []], 0
    made = False  # the gradient partition
    for i, at, until_next in arrivals:
        n, _, safe = params[i]
        g = int(safe and autocast)  # its bucket: bf16 for torch_autocast's safe modules, else its own dtype
        if filled[g] and filled[g] + n > red["bucket"]:
            norms = max((mine.get(j, 0) if mine is not None else params[j][0] for j in held[g]), default=0) * norm
            peak = max(peak, at + max(filled[g] * (b + 2 * g), norms) + (gip if made else 0))
            made = made or mine is None or any(j in mine for j in held[g])
            filled[g], held[g] = 0, []
        filled[g] += n
        held[g].append(i)
        peak = max(peak, until_next + (gip if made else 0))
    return peak



def spanning_elements(cfg, W: int, bucket: int, order: list[int] | None = None) -> int:
    """Elements of a reduction pass's buckets whose gradients go to more than one rank's partition of their
    data-parallel group: DeepSpeed (``average_tensor``, ``use_multi_rank_bucket_allreduce``) all-reduces such a
    bucket's slices of one process group as one flat copy (``allreduce_bucket``'s flatten, a cat; a lone slice is
    reduced in place; consecutive slices to one rank of one group are one slice). The buckets are filled per
    communication dtype in ``order`` (the parameters' first gradients: ``grad_arrivals``; else the model's order
    reversed), each parameter's elements going to the ranks its flat group's shares give it (``rank_params``:
    DeepSpeed-MoE's experts over their expert-data-parallel group)."""
    params, autocast = rank_params(cfg, W), autocast_bf16(cfg)
    start, part = [0] * len(params), [1] * len(params)  # each parameter's offset in its flat group, the group's share
    for members in optimizer_groups(params):
        at, share = 0, max(1, math.ceil(sum(params[i][0] for i in members) / params[members[0]][4]))
        for i in members:
            start[i], part[i] = at, share
            at += params[i][0]
    # per communication dtype: its elements, its slices ((process group: an expert's or not, rank, elements), merged)
    filled, slices, out = [0, 0], [[], []], 0

    def spans(g: int) -> int:  # the elements of each process group with more than one slice in the bucket
        per, count = {}, {}
        for group, _, n in slices[g]:
            per[group], count[group] = per.get(group, 0) + n, count.get(group, 0) + 1
        return sum(per[k] for k in per if count[k] > 1)

    for i in (order if order is not None else reversed(range(len(params)))):
        n, _, safe, expert, _ = params[i]
        g = int(safe and autocast)
        if filled[g] and filled[g] + n > bucket:
            out += spans(g)
            filled[g], slices[g] = 0, []
        p, lo = part[i], start[i]
        filled[g] += n
        for r in range(lo // p, (lo + max(n, 1) - 1) // p + 1):
            elems = min(n, (r + 1) * p - lo) - max(0, r * p - lo) if n else 0
            if slices[g] and slices[g][-1][:2] == (expert, r):
                slices[g][-1] = (expert, r, slices[g][-1][2] + elems)
            else:
                slices[g].append((expert, r, elems))
    return out + spans(0) + spans(1)


def reduction_bytes(cfg, W: int, rank: int = 0, order: list[int] | None = None) -> dict[str, int]:
    """Bytes one rank's stage 1/2 gradient handling moves in a step through memory-bound ops, counted by the
    planner's rule (``simulate.op_work``: an op's tensor arguments and outputs, a copy_ 3x its destination):
    DeepSpeed's, in place of memopt's zero1 of the fake step (its ``grad_op_bytes``). A reduction pass (stage 2:
    every micro-batch; stage 1: the last, autograd adding the others into param.grad) copies each gradient into
    its bucket, averages it in place, casts a safe module's to bf16 under torch_autocast and back into the bucket,
    and copies the rank's share back (its elements of each group: DeepSpeed-MoE's experts shared over W / ep
    ranks, ``rank_params``); a bucket reduced to several ranks is flattened first (``spanning_elements``;
    ``order``: the gradients' arrivals, stage 1's the optimizer groups'). The gradient partition (the parameters
    with elements in it, whole: ``in_partition``), without offload: made and copied into each pass, later
    micro-batches' added at the epilogue; with offload, each micro-batch of several staged through the host buffer
    (copied out, copied back and added from the second on), and at the last the share's fp64 norm, its inf/nan
    check and its copy into the fp32 host gradient. Each micro-batch's buckets are made anew (``setup_buckets``).
    {"deepspeed": those, "autograd": stage 1's adds}; DeepSpeed's gradient path's ops counted in real runs:
    tests/planner/test_deepspeed_reduction_bytes.py. On gpt_small bf16 ZeRO-2-Offload at 4 x 4, one rank: 0.25 s a
    micro-batch at one thread measured in its hooks,
    none planned before."""
    from memopt.strategies.zero import selected_stage

    _, stage, scfg = selected_stage(cfg)
    b, m = param_bytes(cfg), max(1, cfg.trainer.grad_accum)
    passes = m if stage == 2 else 1
    params, autocast = rank_params(cfg, W), autocast_bf16(cfg)
    E = sum(p[0] for p in params)
    C = sum(n for n, _, safe, _, _ in params if safe) if autocast else 0  # communicated in bf16
    share = sum(n / G for n, _, _, _, G in params)  # the rank's elements of each group
    whole = sum(params[i][0] for i in in_partition(cfg, W, rank))  # its partition's parameters, whole
    reduce = 5 * b * E + (b + 2) * C + (2 * b + 2) * C  # bucket copy, averaging; the cast and back into the bucket
    reduce += share / E * ((2 * b + 2) * C + 3 * b * (E - C))  # the share copied back
    bucket = bucket_elements(cfg)
    if W > 1:  # the buckets reduced to several ranks: a flat copy of their slices
        if stage == 1:  # reduced after the backward, in the optimizer groups' order (``reduce_gradients``)
            order = [i for members in optimizer_groups(params) for i in members]
        reduce += 2 * b * spanning_elements(cfg, W, bucket, order)
    if cfg.strategy.cpu_offload is not None:
        partition = 0
        if stage == 2 and m > 1:  # staged through the host: out every micro-batch, back in and added from the second
            partition += m * 3 * b * whole + (m - 1) * 6 * b * whole
        to_fp32 = 12 if b == 4 else b + 4 + 12
        partition += ((b + 8) + 8 + 2 * b + to_fp32) * share  # fp64 norm, inf/nan check, the fp32 host gradient
    else:
        partition = passes * 4 * b * whole + (3 * b * whole * (m - 1) if stage == 2 else 0)  # made, copied; added
    accumulated = 3 * b * E * (m - 1) if stage == 1 else 0  # autograd's adds into param.grad
    # each micro-batch's buckets made anew (``setup_buckets``: torch.empty, counted by the rule as written)
    buckets = m * (2 if stage == 2 and scfg.overlap_comm else 1) * comm_dtypes(cfg) * bucket * b
    return {"deepspeed": round(passes * reduce + partition + buckets), "autograd": accumulated}


def allreduce_bytes(cfg, W: int = 1) -> dict[str, int]:
    """Bytes one rank's stage 0 gradient all-reduce moves in a step (``engine.allreduce_gradients`` after the last
    micro-batch: every gradient flattened (2b), averaged in place (2b), copied back into each param.grad (a copy_,
    3b)), counted by the planner's rule, in place of memopt's DDP of the fake step (its ``grad_op_bytes``);
    "autograd": the adds of later micro-batches into param.grad (3b). Checked against DeepSpeed's own ops in
    real runs: tests/planner/test_deepspeed_reduction_bytes.py."""
    b, m = param_bytes(cfg), max(1, cfg.trainer.grad_accum)
    E = sum(p[0] for p in rank_params(cfg, W))  # the rank's own (DeepSpeed-MoE: its experts all-reduced apart)
    return {"deepspeed": 7 * b * E, "autograd": 3 * b * E * (m - 1)}


def stage3_reduction_bytes(cfg, W: int, order: list[int] | None = None, gloo: bool = True) -> int:
    """Bytes one rank's ZeRO-3 gradient handling moves in a step (stage3.py: contiguous gradients,
    reduce_scatter), counted by the planner's rule, in place of memopt's zero3 of the fake step (its
    ``grad_op_bytes``). Each micro-batch, every gradient (b bytes an element) is copied into its communication
    dtype's bucket (c: bf16 for torch_autocast's safe modules, else b; n (2c + b)); a bucket is reduced when the
    next gradient would overflow it (``reduce_bucket_size``: one block, as the translation sets it; filled in
    ``order``, the gradients' arrivals) and at the backward's end: its gradients' rank slices interleaved with
    padding into one flat copy (``reduce_scatter_coalesced``: the padding made, a cat of 2 W s c; none for a lone
    gradient that W divides), averaged in place (2 W s c), reduce-scattered (gloo copies the result out of its
    all-reduced input: 3 s c), cast to b where c differs (s (c + b)) and copied into the gradient partition at the
    first micro-batch, added into it at the later ones (3 s b). With offload, at the last micro-batch each
    partition's fp64 norm (s (b + 8) + 8 s) and its copy into the fp32 host gradient (s (b + 4) where b != 4, 12 s)."""
    from memopt.planner.engines.deepspeed.params import block_numel

    params, b, m = meta_params(cfg), param_bytes(cfg), max(1, cfg.trainer.grad_accum)
    autocast, bucket = autocast_bf16(cfg), block_numel(cfg)
    filled, held, total = [0, 0], [[], []], 0

    def reduce(g: int) -> int:
        c, ns = (2 if g else b), [params[i][0] for i in held[g]]
        out = 0
        for n in ns:
            s = math.ceil(n / W)
            flat = len(ns) > 1 or n % W  # interleaved into a flat copy: its padding made, the cat
            out += ((W * s - n) * c + 2 * W * s * c if flat else 0) + 2 * W * s * c  # + the averaging
            out += 3 * s * c * gloo + (s * (c + b) if c != b else 0) + 3 * s * b  # gloo's copy, the cast, the partition
        return out

    for i in (order if order is not None else reversed(range(len(params)))):
        n, _, safe = params[i]
        g = int(safe and autocast)
        if filled[g] and filled[g] + n > bucket:
            total += reduce(g)
            filled[g], held[g] = 0, []
        filled[g] += n
        held[g].append(i)
        total += n * (2 * (2 if g else b) + b)
    total += reduce(0) + reduce(1)
    boundary = 0
    if cfg.strategy.cpu_offload is not None:
        share = sum(math.ceil(n / W) for n, _, _ in params)
        boundary = share * ((b + 8) + 8 + (b + 4 if b != 4 else 0) + 12)
    return m * total + boundary
