"""Ranks and their dimensions: launching local workers (launch.py) and the device mesh with named
data-parallel, expert and tensor dimensions (dims.py)."""
from memopt.parallel.dims import Dim, ParallelConfig, ParallelDims, build_dims
from memopt.parallel.launch import RankFailure, launch, setup, teardown, under_launcher

__all__ = ["Dim", "ParallelConfig", "ParallelDims", "RankFailure", "build_dims", "launch", "setup", "teardown", "under_launcher"]
