"""Kernel tests run under Triton's interpreter on a machine without CUDA, compiled on one with CUDA.

``triton.jit`` decides at decoration (import) time whether a kernel is interpreted, so
``TRITON_INTERPRET`` must be set before any test module imports triton or ``memopt.kernels``
(``import torch`` does not import triton). ``setdefault`` keeps an explicit choice:
``TRITON_INTERPRET=1 pytest tests/kernels`` interprets them on a GPU machine too.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
