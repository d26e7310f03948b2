"""Where the loss head's time goes on a GPU: the dense head against ``+strategy=chunked_loss``.

The GPU checks measured ``[bf16,chunked_loss]`` 9-53% slower per step than plain bf16 on gpt_1b's width with 4
layers (experiments/strategies/README.md, experiments/planner/README.md), where the extra FLOPs (one more
output projection) account for about 10%. This script times the head alone at those shapes (the final
LayerNorm's fp32 output x (N, C) with gradient, the tied fp32 weight (V, C), bf16 autocast as the trainer runs
it), forward + backward, both ways:

* queued wall time per call (CUDA events over calls launched back to back) and the host's own time per call;
* GPU time per kernel (``torch.profiler``), the top kernels of each;
* the chunk size swept (``--chunks``), since the loop's kernels shrink with it.

Usage (a CUDA machine): ``python experiments/strategies/loss_head_profile.py OUT_DIR`` (writes
``loss_head_profile.json`` and prints a table). Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from memopt.models.base import dense_lm_loss  # noqa: E402
from memopt.strategies.chunked_loss import ChunkedLoss  # noqa: E402


class Head(torch.nn.Module):
    """The tied output layer: a bias-free linear whose weight is the fp32 master copy."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(w)

    def forward(self, x):
        return F.linear(x, self.weight)


def step(loss_head, x, head, targets):
    x.grad = head.weight.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = loss_head(x, head, targets)
    loss.backward()


def timed(fn, reps: int = 5, queued: int = 5) -> dict:
    walls, hosts = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        for _ in range(queued):
            fn()
        hosts.append(1e3 * (time.perf_counter() - t0) / queued)
        b.record()
        torch.cuda.synchronize()
        walls.append(a.elapsed_time(b) / queued)
    walls.sort(), hosts.sort()
    return {"wall_ms": walls[len(walls) // 2], "host_ms": hosts[len(hosts) // 2]}


def kernels(fn, top: int = 8) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            rows.append({"kernel": e.key[:90], "calls": e.count, "gpu_ms": t / 1e3})
    rows.sort(key=lambda r: -r["gpu_ms"])
    return rows[:top] + [{"kernel": "(all)", "calls": sum(r["calls"] for r in rows), "gpu_ms": sum(r["gpu_ms"] for r in rows)}]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=8192)  # micro-batch 4 x seq 2048, the check's
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 4096, 8192])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("loss_head_profile: no CUDA device here; nothing measured")
        return 0
    os.makedirs(args.out, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.tokens, args.width, device="cuda", generator=g).requires_grad_()
    head = Head(0.02 * torch.randn(args.vocab, args.width, device="cuda", generator=g))
    targets = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=g)
    ways = {"dense": dense_lm_loss, **{f"chunked {c}": ChunkedLoss(c) for c in args.chunks}}
    flops = 6 * args.tokens * args.width * args.vocab  # the dense head's forward + backward products
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens,
           "width": args.width, "vocab": args.vocab, "ways": {}}
    for name, lh in ways.items():
        fn = lambda lh=lh: step(lh, x, head, targets)  # noqa: E731
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        r = timed(fn)
        r["peak_over_start_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        r["dense_tflops"] = flops / (r["wall_ms"] * 1e-3) / 1e12
        r["kernels"] = kernels(fn)
        res["ways"][name] = r
    with open(os.path.join(args.out, "loss_head_profile.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"loss head fwd+bwd on {res['device']}, torch {res['torch']}: N={args.tokens} C={args.width} V={args.vocab}")
    print(f"{'way':<16}{'wall ms':>9}{'host ms':>9}{'TFLOP/s*':>10}{'peak MiB':>10}")
    for name, r in res["ways"].items():
        print(f"{name:<16}{r['wall_ms']:>9.3f}{r['host_ms']:>9.3f}{r['dense_tflops']:>10.1f}{r['peak_over_start_mib']:>10.0f}")
    print("(* the dense head's 6NCV FLOPs over the wall time, for every way)")
    for name, r in res["ways"].items():
        print(f"-- {name}: top kernels (GPU ms, calls)")
        for k in r["kernels"]:
            print(f"   {k['gpu_ms']:8.3f} {k['calls']:5d}  {k['kernel']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
