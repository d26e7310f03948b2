"""Kernel tests run under Triton's interpreter unless told otherwise.

``triton.jit`` decides at decoration (import) time whether a kernel is
interpreted, so ``TRITON_INTERPRET`` must be set before any test module imports
triton or ``memopt.kernels``.  ``setdefault`` keeps an explicit choice: on a GPU
machine run ``TRITON_INTERPRET=0 pytest tests/kernels`` to test the compiled
kernels on CUDA (that also enables the bf16 test).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
