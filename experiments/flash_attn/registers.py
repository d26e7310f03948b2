"""Registers, spills and shared memory of the compiled kernels, without a GPU.

Compiles the FlashAttention kernels for sm_90a (Triton's ahead-of-time
pipeline) and runs the ptxas that ships with Triton on the PTX with ``-v``:
what a GPU run would load, minus the timing.  Used to review the GPU path of
the causal stage split (each stage is its own loop, so values live across
two or three loops instead of one).

    python experiments/flash_attn/registers.py                 # the fixed blocks
    python experiments/flash_attn/registers.py --autotune      # every autotune config kept by pruning
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

PTR = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}
CASES = (("fp16", 64, True), ("fp16", 128, True), ("bf16", 128, False), ("fp32", 64, True))


def _ptxas() -> str:
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):  # the newer one reads the PTX version Triton emits
        if (bin_dir / name).exists():
            return str(bin_dir / name)
    raise SystemExit(f"no ptxas under {bin_dir}")


def _compile(fn, dt, consts, num_warps, num_stages):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("LSE", "DELTA"):
            sig[name] = "*fp32"
        elif name in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV"):
            sig[name] = PTR[dt]
        else:
            sig[name] = "fp32" if name in ("qk_scale_log2", "sm_scale") else "i32"
    return triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _ptxas_stats(kernel, ptxas: str) -> tuple[int, int]:
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        Path(ptx).write_text(kernel.asm["ptx"])
        res = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True)
    out = res.stdout + res.stderr
    regs, spill = re.search(r"Used (\d+) registers", out), re.search(r"(\d+) bytes spill stores", out)
    if res.returncode or not (regs and spill):
        raise SystemExit(f"ptxas failed: {out[-2000:]}")
    return int(regs.group(1)), int(spill.group(1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--autotune", action="store_true", help="every autotune config kept by pruning")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compiled mode
    import torch

    from memopt.kernels import flash_attn as fa

    ks, ptxas = fa._kernels(False), _ptxas()
    print("| dtype | D | causal | kernel | BLOCK_M x BLOCK_N | warps/stages | registers | spill bytes | shared bytes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dt, d, causal in CASES:
        elem = 4 if dt == "fp32" else 2
        blk = fa._fixed_blocks(d, False, elem)
        tuned = {"fwd": fa._FWD_TUNE, "dkdv": fa._DKDV_TUNE, "dq": fa._DQ_TUNE}
        fixed = {"fwd": blk.fwd, "dkdv": blk.dkdv, "dq": blk.dq}
        for name in ("fwd", "dkdv", "dq"):
            if args.autotune:
                q = torch.empty(0, dtype=torch.float32 if elem == 4 else torch.float16)
                kept = fa._prune_for_head_dim(fa._configs(tuned[name]), {"Q": q}, HEAD_DIM=d)
                configs = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept]
            else:
                configs = [(*fixed[name], blk.num_warps, blk.num_stages)]
            for bm, bn, warps, stages in configs:
                consts = dict(HEAD_DIM=d, CAUSAL=causal, DOT_PRECISION="ieee" if dt == "fp32" else "tf32",
                              BLOCK_M=bm, BLOCK_N=bn)
                kernel = _compile(getattr(ks, name), dt, consts, warps, stages)
                regs, spill = _ptxas_stats(kernel, ptxas)
                print(f"| {dt} | {d} | {causal} | {name} | {bm}x{bn} | {warps}/{stages} | {regs} | {spill} | "
                      f"{kernel.metadata.shared} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
