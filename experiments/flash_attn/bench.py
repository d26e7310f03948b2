"""Benchmark memopt's Triton FlashAttention against PyTorch SDPA and naive attention.

Measures, per (dtype, head dim, causal, sequence length):
  * forward and forward+backward throughput in TFLOP/s, and
  * peak GPU memory allocated during one forward(+backward) call, above the
    memory already held by the inputs.

Shapes follow the FlashAttention papers' convention: a fixed token budget
(batch * seq_len = --tokens, default 16384) and a fixed model width
(heads * head_dim = --hidden, default 2048), so every row does a comparable
amount of work and longer sequences mean fewer batch elements.

FLOP counts (matmuls only): forward = 4 * B * H * Nq * Nk * D (QK^T and PV),
backward = 2.5x forward (five matmuls instead of two); causal halves both.

Needs a CUDA GPU; exits with a message otherwise.  Usage:

    python experiments/flash_attn/bench.py                       # full sweep
    python experiments/flash_attn/bench.py --seqlens 1024 4096 --dtypes bf16 --head-dims 128
    python experiments/flash_attn/bench.py --out experiments/flash_attn/results.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import platform
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def naive_attention(q, k, v, causal: bool, scale: float):
    """Materialises the (B, H, N, N) score/probability matrices: O(N^2) memory."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.matmul(p, v)


def sdpa_attention(q, k, v, causal: bool, scale: float):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def flash_attention(q, k, v, causal: bool, scale: float):
    from memopt.kernels.flash_attn import flash_attn

    return flash_attn(q, k, v, causal=causal, softmax_scale=scale)


PROVIDERS = {"flash": flash_attention, "sdpa": sdpa_attention, "naive": naive_attention}


def attention_flops(b, h, n, d, causal: bool, mode: str) -> float:
    f = 4.0 * b * h * n * n * d
    if causal:
        f /= 2
    return f * (3.5 if mode == "fwd_bwd" else 1.0)


def naive_fits(b, h, n, dtype, mode, free_bytes) -> bool:
    # scores (dtype) + fp32 softmax + probs (dtype) [+ their grads in backward]
    per = b * h * n * n
    need = per * (2 * torch.finfo(dtype).bits // 8 + 4) * (2 if mode == "fwd_bwd" else 1)
    return need < 0.8 * free_bytes


def bench_one(fn, q, k, v, causal, scale, mode):
    import triton.testing

    if mode == "fwd":

        def run():
            with torch.no_grad():
                fn(q, k, v, causal, scale)

    else:
        do = torch.randn_like(q)

        def run():
            for t in (q, k, v):
                t.grad = None
            fn(q, k, v, causal, scale).backward(do)

    run()  # compile / autotune outside the measurement
    torch.cuda.synchronize()
    for t in (q, k, v):
        t.grad = None
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = triton.testing.do_bench(run, warmup=25, rep=100)
    return ms, peak


def measure_row(prov, b, h, n, d, dtype, causal, scale, mode) -> str:
    """'ms | TFLOP/s | peak MiB' for one configuration, or why it was not measured."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if prov == "naive" and not naive_fits(b, h, n, dtype, mode, free):
        return "skipped (N^2 scores would not fit) | |"
    grad = mode == "fwd_bwd"
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=grad) for _ in range(3))
    try:
        ms, peak = bench_one(PROVIDERS[prov], q, k, v, causal, scale, mode)
    except torch.cuda.OutOfMemoryError:
        return "OOM | |"
    finally:
        del q, k, v
    tflops = attention_flops(b, h, n, d, causal, mode) / (ms * 1e-3) / 1e12
    return f"{ms:.3f} | {tflops:.1f} | {peak / 2**20:.0f}"


def check_correctness(dtype, d, causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 1000, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    scale = 1 / math.sqrt(d)
    out = flash_attention(q, k, v, causal, scale)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = sdpa_attention(q32, k32, v32, causal, scale)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), do.float())
    errs = [(out.float() - ref).abs().max().item()] + [
        (g.float() - r).abs().max().item() for g, r in zip(grads, ref_grads)
    ]
    return max(errs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=sorted(DTYPES))
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--causal", choices=["true", "false", "both"], default="both")
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwd_bwd"], choices=["fwd", "fwd_bwd"])
    ap.add_argument("--providers", nargs="+", default=["flash", "sdpa", "naive"], choices=sorted(PROVIDERS))
    ap.add_argument("--tokens", type=int, default=16384, help="batch * seq_len per row (default 16384)")
    ap.add_argument("--hidden", type=int, default=2048, help="heads * head_dim (default 2048)")
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print(
            "bench.py needs a CUDA GPU (torch.cuda.is_available() is False). The FlashAttention "
            "kernel only runs on CPU under Triton's interpreter, which is far too slow to benchmark. "
            "Run this on a machine with an NVIDIA GPU.",
            file=sys.stderr,
        )
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("bench.py: unset TRITON_INTERPRET (the interpreter is not a benchmark target).", file=sys.stderr)
        return 2

    import triton

    causals = {"true": [True], "false": [False], "both": [True, False]}[args.causal]
    dev = torch.cuda.get_device_name()
    header = (
        f"GPU: {dev}; torch {torch.__version__}; triton {triton.__version__}; CUDA {torch.version.cuda}; "
        f"host {platform.node()}; {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; "
        f"tokens={args.tokens}, hidden={args.hidden}"
    )
    print(header)

    for dname in args.dtypes:
        for d in args.head_dims:
            for causal in causals:
                err = check_correctness(DTYPES[dname], d, causal)
                print(f"correctness vs fp32 SDPA: {dname} d={d} causal={causal}: max abs err {err:.2e}")

    rows = []
    cols = "| dtype | D | causal | N | B x H | mode | provider | ms | TFLOP/s | peak MiB |"
    print(cols)
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        for d in args.head_dims:
            h = max(1, args.hidden // d)
            for causal in causals:
                for n in args.seqlens:
                    b = max(1, args.tokens // n)
                    scale = 1 / math.sqrt(d)
                    for mode in args.modes:
                        for prov in args.providers:
                            cells = measure_row(prov, b, h, n, d, dtype, causal, scale, mode)
                            row = f"| {dname} | {d} | {causal} | {n} | {b} x {h} | {mode} | {prov} | {cells} |"
                            print(row, flush=True)
                            rows.append(row)

    if args.out is not None:
        sep = "|" + "---|" * (cols.count("|") - 1)
        args.out.write_text("\n".join([header, "", cols, sep, *rows, ""]))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
