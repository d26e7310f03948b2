"""DeepSpeed's CPU shared-memory all-reduce workspace, unlinked as soon as every rank has mapped it.

On the CPU accelerator, DeepSpeed's communication backend (``deepspeed.comm.torch.TorchBackend``)
creates one POSIX shared-memory segment per rank (``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_
<MASTER_PORT>_<rank>``, about 69 MB) for its inference all-reduce, maps every other rank's, and never
unlinks them: each engine=deepspeed run left ~69 MB per rank of RAM behind until a reboot (hundreds
of runs filled 19 GB of a 24 GiB machine). Training never uses that all-reduce (torch.distributed
does), and a mapping outlives its name, so once every rank has opened its peers' segments (when the
backend's constructor returns) each rank unlinks its own: nothing is left even if the run is killed.
"""
from __future__ import annotations

import os


def segment_name(rank: int) -> str:
    """The name DeepSpeed's ``shm_initialize`` gives rank ``rank``'s segment (shm.cpp)."""
    return (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def init_comm_and_unlink_workspace() -> None:
    """Create DeepSpeed's communication backend over the existing process group (what
    ``deepspeed.initialize`` would do), wait for every rank to have mapped its peers' workspaces,
    then unlink this rank's."""
    import deepspeed.comm.comm as ds_comm  # the module holding the backend (``cdb``), not the package's copy
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    ds_comm.init_distributed(dist_backend=get_accelerator().communication_backend_name(), dist_init_required=False,
                             verbose=False)
    if ds_comm.cdb is None or getattr(ds_comm.cdb, "shm_comm_op", None) is None:
        return  # no shared-memory op on this accelerator: nothing was created
    if dist.get_world_size() > 1:
        dist.barrier()
    try:
        from _posixshmem import shm_unlink
    except ImportError:  # not a POSIX system: DeepSpeed's CPU op does not build there either
        return
    try:
        shm_unlink(segment_name(dist.get_rank()))
    except FileNotFoundError:  # LOCAL_SIZE differed from the world size: DeepSpeed made none
        pass
