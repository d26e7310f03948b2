"""FSDP2's wing: a process group even for one rank, and ``CPUOffloadPolicy`` in the fake step (the
copies between memories a GPU run makes).

On a GPU, FSDP2 with offload keeps each sharded parameter (fp32, pinned) and each sharded gradient
on the host, and AdamW's states and step follow them (the engine counts those under ``host_scope``).
Its device holds a group's shards copied host->device for the all-gather
(``FSDPParam.all_gather_inputs``: ``.to(device, non_blocking=True)``, then the cast to the
parameter dtype), the gathered parameters, and the reduce-scatter output until each parameter's
slice is copied device->host (``foreach_reduce``: ``.to("cpu")``). The fake step runs on the CPU,
where both ``.to`` calls return their input, so this patch makes the two copies explicitly: the
all-gather input from a device copy of the shard, each new gradient as a host copy of its slice
(the reduce-scatter output then dies with the call, as on the GPU; an accumulated micro-batch's
host copy is counted at its peak and dropped). ``reset_sharded_param`` (the shard's re-padding
and pinning, at ``to_empty`` and lazy init) makes host tensors only.

Checked against the parameter count only (tests/planner/test_plan_mode.py): no GPU here to measure.
"""
from __future__ import annotations

import contextlib

import torch

from memopt.memory.tracker import HOST
from memopt.planner.engines.base import Wing

OFFLOAD_ON_CPU = (
    "engine=fsdp2 with cpu_offload runs on a CUDA device only (engines/fsdp2.py validate): this hardware profile's "
    "device is the host, so there is no run to plan; use a GPU profile (hardware=a100_80g), or engine=memopt or "
    "engine=deepspeed for cpu_offload on CPU")


def step_patch(cfg, backend: str):
    """The offload copies around the fake step (None without cpu_offload); a CPU profile has no run to plan.
    Replicas of an unsharded model (HSDP with dp_shard=1) are not planned: their 2-D mesh needs process groups
    the planner's fake one cannot make."""
    from memopt.parallel.dims import expected_world, resolve_sizes

    sizes = resolve_sizes(cfg.parallel, expected_world(cfg))
    if sizes["dp_replicate"] > 1 and sizes["dp_shard_mod_ep"] < 2:
        from memopt.planner.simulate import PlanUnsupported

        raise PlanUnsupported(f"engine=fsdp2 with parallel.dp_replicate={sizes['dp_replicate']} and dp_shard=1 (replicas of "
                              "an unsharded model) is not planned; HSDP with dp_shard >= 2 is")
    if cfg.strategy.cpu_offload is None:
        return None
    if backend == "gloo":
        from memopt.planner.simulate import PlanUnsupported

        raise PlanUnsupported(OFFLOAD_ON_CPU)
    return fsdp2_offload


@contextlib.contextmanager
def fsdp2_offload(tracker):
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState

    gather_inputs, reset, reduce = FSDPParam.all_gather_inputs, FSDPParam.reset_sharded_param, _fsdp_param_group.foreach_reduce

    def all_gather_inputs(fp):
        if not (fp.offload_to_cpu and fp.sharded_state == ShardedState.SHARDED):
            return gather_inputs.fget(fp)
        host = fp._sharded_param_data
        fp._sharded_param_data = torch.empty_like(host).copy_(host)  # the host->device copy: device memory
        try:
            return gather_inputs.fget(fp)
        finally:
            fp._sharded_param_data = host

    def reset_sharded_param(fp):
        with tracker.category("params"), (tracker.host_scope() if fp.offload_to_cpu else contextlib.nullcontext()):
            return reset(fp)

    def foreach_reduce(fsdp_params, *args, **kwargs):
        out = reduce(fsdp_params, *args, **kwargs)
        for fp in fsdp_params:
            grad = fp.sharded_param.grad
            if not fp.offload_to_cpu or grad is None:
                continue
            local = grad._local_tensor
            with tracker.category("grads"), tracker.host_scope():
                if tracker._device_of(local) == HOST:  # accumulated in place into the host gradient
                    torch.empty_like(local)  # the device->host copy added to it: counted at its peak, freed
                else:  # a view of the device's reduce-scatter output: the device->host copy replaces it
                    fp.sharded_param.grad = fp.to_sharded_dtensor(torch.empty_like(local).copy_(local))
        return out

    FSDPParam.all_gather_inputs = property(all_gather_inputs)
    FSDPParam.reset_sharded_param = reset_sharded_param
    _fsdp_param_group.foreach_reduce = foreach_reduce
    try:
        yield
    finally:
        FSDPParam.all_gather_inputs, FSDPParam.reset_sharded_param = gather_inputs, reset
        _fsdp_param_group.foreach_reduce = reduce


WING = Wing(step_patch=step_patch, process_group_always=True, micro_batches_repeat=True, model_bound=lambda cfg: True)
