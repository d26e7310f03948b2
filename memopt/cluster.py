"""Multi-node jobs under hydra-submitit-launcher: each task of a submitit job becomes one rank.

A sweep on SLURM (``hydra/launcher=memopt_slurm``) makes every job one SLURM job of ``nodes x
tasks_per_node`` tasks, one per device, which is the process layout ``torchrun --nnodes N
--nproc_per_node G`` creates. submitit describes the layout in its own variables (SLURM's, or
``SUBMITIT_LOCAL_*`` for the local executor); this module exports the ``env://`` variables torchrun
would have set (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), so memopt's
"external launcher" path takes over unchanged: one rank per process, rank 0's run directory, rank 0
writes the records.
"""
from __future__ import annotations

import os


def adopt_submitit_ranks() -> int:
    """Export torch's rendezvous variables inside a multi-task submitit job; returns the world size
    (1 and no change outside submitit, with a single task, or when a launcher already set them)."""
    if "WORLD_SIZE" in os.environ or "SUBMITIT_EXECUTOR" not in os.environ:
        return int(os.environ.get("WORLD_SIZE", "1"))
    try:
        from submitit import JobEnvironment
        from submitit.helpers import TorchDistributedEnvironment
    except ImportError:
        return 1
    if JobEnvironment().num_tasks <= 1:
        return 1
    env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    return env.world_size
