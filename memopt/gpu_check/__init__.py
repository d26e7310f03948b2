"""A prepared GPU check: the first measurements of memopt on a real accelerator, in a few minutes.

``make gpu-check OUT=dir`` (or ``python3 -m memopt.gpu_check dir``) on a GPU machine without network
access, from the repository root. It needs only the machine's own ``python3`` with torch and triton
(any recent release: nothing of memopt's own virtual environment); the pure-Python packages memopt
needs beyond those (hydra-core, omegaconf, antlr4) come as wheels in ``.whl/`` (``make gpu-wheels``,
run where pip reaches a registry) and are installed into a temporary target directory, put on
``sys.path`` and on ``PYTHONPATH`` for the subprocesses.

On a machine without CUDA it prints one line and exits 0. On CUDA it runs, within a global time
budget (``--budget``, default 420 s), each section with its own cap:

* ``env``: GPU, driver, torch / triton / Python versions, the wheel install, ``import memopt.train``;
* ``tests``: the kernel tests (``tests/kernels``) compiled for the GPU (``TRITON_INTERPRET=0``, fixed
  tiles: ``MEMOPT_FLASH_NO_AUTOTUNE=1``, which keeps the compile count small), ``test_bf16_cuda``
  included, and the tests marked ``cuda`` elsewhere;
* ``flash``: memopt's Triton FlashAttention (autotuned, as training runs it) forward + backward
  against PyTorch SDPA's flash backend, fp16 and bf16, head dim 64 and 128, causal, N = 1024, 4096,
  16384: max abs error of the output and of dq, dk, dv against an fp32 reference (SDPA's math
  backend on fp32 copies), median time (CUDA events), TFLOP/s and peak bytes of both;
* ``compositions``: five compositions on one GPU (six with DeepSpeed's), each planned (``trainer.mode=plan``, fake tensors,
  started in the background at the beginning) and trained for a few steps: planned vs measured
  device peak (the tracker's and ``torch.cuda.max_memory_allocated``), planned vs measured step time,
  the relative errors; the ZeRO-Offload step time, beside DeepSpeed's where its wheels travelled (``make
  gpu-wheels`` puts them in .whl/; DeepSpeed's CPU Adam op is built in the background);
* ``throughput``: every composition that trained, rerun without the memory tracker (plain first, then the
  fastest): tokens/s, MFU, the planned step against the untracked one, and the tracker's cost.

Every section runs in its own ``try`` and (where it touches the GPU) in its own subprocess with a
timeout; ``gpu_check.json`` and ``gpu_check.txt`` are rewritten after every section, so a section
that fails or hangs loses nothing else. ``gpu_check_logs.txt`` holds the tail of every subprocess's
output. Exit code 0 whatever the results (they are in the files); 2 only for bad arguments.

``--cpu-dry-run`` runs the same orchestration on a CPU (tiny model, CUDA-only parts skipped with
their reason): it is how the plumbing is tested without a GPU (``tests/unit/test_gpu_check.py``).
"""

