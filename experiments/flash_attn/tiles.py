"""How many attention tiles the causal stage split leaves unmasked (no GPU needed).

The kernels run causal attention in stages: tiles wholly below the diagonal
without any mask, only the tiles that straddle it with the per-element causal
mask (before the split every visited tile was masked).  This counts, for the
kernels' fixed GPU block sizes and a sequence length T, each (query tile,
key tile) pair by its geometry alone (independently of the kernels' loop
bounds): skipped (every key after every query), off-band (every key at or
before every query) or diagonal (masked).  For square B x B tiles and T a
multiple of B, n = T / B tiles per side: n (n + 1) / 2 tiles are visited,
n of them diagonal, so the masked fraction falls from 1 to 2 / (n + 1); the
same holds with n = T / max(BLOCK_M, BLOCK_N) when one block divides the other.

    python experiments/flash_attn/tiles.py --seqlens 512 1024 4096 16384
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def count_tiles(t: int, block_m: int, block_n: int) -> tuple[int, int]:
    """(off-band, diagonal) tile pairs of causal T x T attention with BLOCK_M-row, BLOCK_N-key tiles."""
    off = diag = 0
    for m0 in range(0, t, block_m):
        last_row = min(m0 + block_m, t) - 1
        for n0 in range(0, t, block_n):
            last_key = min(n0 + block_n, t) - 1
            if n0 > last_row:
                continue  # every key after every query: never visited
            if last_key <= m0:
                off += 1
            else:
                diag += 1
    return off, diag


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--elem-size", type=int, default=2, help="bytes per input element (2: fp16/bf16)")
    args = ap.parse_args(argv)

    from memopt.kernels.flash_attn import _fixed_blocks

    blk = _fixed_blocks(args.head_dim, interpreted=False, elem_size=args.elem_size)
    kernels = {"forward": blk.fwd, "dK/dV": blk.dkdv, "dQ": blk.dq}
    print(f"D={args.head_dim}, {args.elem_size}-byte inputs; masked / visited tiles (formula 2/(n+1), n = T/max block)")
    print(f"| T | {' | '.join(f'{k} {m}x{n}' for k, (m, n) in kernels.items())} |")
    print("|---|" + "---|" * len(kernels))
    for t in args.seqlens:
        cells = []
        for m, n in kernels.values():
            off, diag = count_tiles(t, m, n)
            formula = 2 / (t / max(m, n) + 1)
            cells.append(f"{diag} / {off + diag} = {diag / (off + diag):.1%} ({formula:.1%})")
        print(f"| {t} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
