"""Host-side AdamW step: memopt CPUAdamW vs DeepSpeedCPUAdam vs torch.optim.AdamW (fused / foreach).

All contenders update the same fp32 parameter, gradient and exp_avg/exp_avg_sq tensors (a few
flat tensors, like ZeRO-Offload's master shards). Rounds are interleaved
(the order rotates every round) and each contender's time is the median over rounds, so load
from other processes on a shared machine hits all of them alike. Bytes moved per parameter:
read p, g, m, v (16 B) + write p, m, v (12 B) = 28 B; 30 B when an fp16 copy is also written.
The machine's memory bandwidth is measured beside it with large (256 MiB) tensor ops timed in the
same rounds.

    PYTHONPATH=. python experiments/cpu_adam/bench.py              # 25M and 100M params
    PYTHONPATH=. python experiments/cpu_adam/bench.py --sizes 25e6 --reps 31 --no-foreach

DeepSpeed's CPU Adam op is compiled on first use (minutes); DS_ACCELERATOR=cpu is set when not
given. If DeepSpeed cannot be imported or built, a message says so and the others are timed.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from memopt.optim.cpu_adam import CPUAdamW, kernel_error, kernel_simd_width, load_kernel  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.1
BYTES = 28  # read p, g, m, v (16) + write p, m, v (12)
BYTES_LOWP = 30  # + fp16 copy of p (2)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except Exception:
        pass
    return platform.processor() or platform.machine()


def split_sizes(total: int, parts: int) -> list[int]:
    """``parts`` flat tensors of uneven sizes summing to ``total``, none a multiple of 16."""
    weights = [2.0 ** -(i + 1) for i in range(parts)]
    sizes = [int(total * w / sum(weights)) | 1 for w in weights]
    sizes[0] += total - sum(sizes)
    if sizes[0] % 16 == 0:
        sizes[0] -= 1
        sizes[-1] += 1
    return sizes


def load_deepspeed():
    try:
        import logging

        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        # build (or load the cached build of) the op now, outside any timing
        probe = torch.nn.Parameter(torch.zeros(8))
        t0 = time.perf_counter()
        DeepSpeedCPUAdam([probe], lr=LR)
        return DeepSpeedCPUAdam, f"ok (op ready in {time.perf_counter() - t0:.1f} s)"
    except Exception as e:  # import error, no compiler, ...
        return None, f"unavailable: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"


def timed_rounds(contenders: dict, reps: int, warmup: int) -> dict[str, list[float]]:
    names = list(contenders)
    for name in names:
        for _ in range(warmup):
            contenders[name]()
    times = {n: [] for n in names}
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def bandwidth_ops() -> dict[str, tuple]:
    """Large streaming ops, 64 Mi fp32 elements (256 MiB) per tensor: name -> (fn, bytes/element, n)."""
    n = 64 * 2**20
    a, b, c = torch.rand(n), torch.rand(n), torch.empty(n)
    return {
        "copy c=a (rd 4 + wr 4 B)": (lambda: c.copy_(a), 8, n),
        "in-place a+=b (rd 8 + wr 4 B)": (lambda: a.add_(b, alpha=1e-9), 12, n),
        "triad c=a+s*b (rd 8 + wr 4 B)": (lambda: torch.add(a, b, alpha=0.5, out=c), 12, n),
    }


def bench_size(total: int, parts: int, reps: int, ds_cls, foreach: bool, lowp: bool, bw: dict):
    sizes = split_sizes(total, parts)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in sizes]
    grads = [torch.randn(s) * 1e-3 for s in sizes]
    for p, g in zip(params, grads):
        p.grad = g
    data = [p.data for p in params]

    # Every contender updates the same p, g and also the same exp_avg/exp_avg_sq buffers (each
    # optimizer's own states are swapped for these after its first step), so all touch exactly the
    # same memory: on this VM, which physical pages back a buffer moved single-buffer timings by
    # several percent, more than the differences being measured. The values stay ordinary AdamW
    # states, only updated by several optimizers in turn.
    exp_avg = [torch.zeros(s) for s in sizes]
    exp_avg_sq = [torch.zeros(s) for s in sizes]

    def share_torch_state(opt):
        opt.step()
        for p, m, v in zip(params, exp_avg, exp_avg_sq):
            opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"] = m, v

    def share_memopt_state(opt):
        opt.exp_avg, opt.exp_avg_sq = list(exp_avg), list(exp_avg_sq)

    c: dict[str, callable] = {}
    opt_cpp = CPUAdamW(data, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, impl="cpp")
    share_memopt_state(opt_cpp)
    c["memopt CPUAdamW (C++ kernel)"] = lambda: opt_cpp.step(grads)
    opt_tp = CPUAdamW(data, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, impl="torch")
    share_memopt_state(opt_tp)
    c["memopt CPUAdamW (torch fallback)"] = lambda: opt_tp.step(grads)
    if ds_cls is not None:
        opt_ds = ds_cls(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
        share_torch_state(opt_ds)
        c["DeepSpeedCPUAdam"] = opt_ds.step
    opt_fused = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    share_torch_state(opt_fused)
    c["torch AdamW(fused=True)"] = opt_fused.step
    if foreach:
        opt_fe = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=True)
        share_torch_state(opt_fe)
        c["torch AdamW(foreach=True)"] = opt_fe.step
    if lowp:
        outs = [torch.empty(s, dtype=torch.float16) for s in sizes]

        def copy_out():
            for o, p in zip(outs, data):
                o.copy_(p)

        c["+fp16 copy: memopt C++ fused"] = lambda: opt_cpp.step(grads, out=outs)
        c["+fp16 copy: memopt C++ then copy_"] = lambda: (opt_cpp.step(grads), copy_out())
        if ds_cls is not None:
            c["+fp16 copy: DeepSpeed then copy_"] = lambda: (opt_ds.step(), copy_out())
        c["+fp16 copy: torch fused then copy_"] = lambda: (opt_fused.step(), copy_out())

    for name, (fn, _, _) in bw.items():  # the bandwidth probes run in the same rounds, same conditions
        c["bw: " + name] = fn
    with torch.no_grad():
        times = timed_rounds(c, reps, warmup=2)
    gbps = {}
    for name, (_, nbytes, n) in bw.items():
        gbps[name] = nbytes * n / statistics.median(times.pop("bw: " + name)) / 1e9
    ds_name = "DeepSpeedCPUAdam"
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        nbytes = BYTES_LOWP if name.startswith("+fp16") else BYTES
        row = {"size": total, "sizes": sizes, "name": name, "ms": med * 1e3, "min_ms": min(ts) * 1e3,
               "params_per_s": total / med, "gbps": nbytes * total / med / 1e9, "bytes": nbytes}
        if ds_name in times:
            ds_med = statistics.median(times[ds_name])
            row["ratio"] = med / ds_med
            # paired: per-round ratio (same round, adjacent in time), median over rounds
            row["paired"] = statistics.median(a / b for a, b in zip(ts, times[ds_name]))
        rows.append(row)
    return rows, gbps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[25e6, 100e6], help="total parameters per case")
    ap.add_argument("--tensors", type=int, default=3, help="flat tensors the parameters are split into")
    ap.add_argument("--reps", type=int, default=21, help="timed rounds (median reported)")
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="torch.set_num_threads values to run (default: 1 and torch's default)")
    ap.add_argument("--no-foreach", dest="foreach", action="store_false", help="skip the slow foreach AdamW")
    ap.add_argument("--no-lowp", dest="lowp", action="store_false", help="skip the fp16 copy-out cases")
    ap.add_argument("--no-deepspeed", dest="deepspeed", action="store_false")
    args = ap.parse_args(argv)
    threads = args.threads or sorted({1, torch.get_num_threads()})

    t0 = time.perf_counter()
    if load_kernel() is None:
        sys.exit(f"memopt C++ kernel could not be built: {kernel_error()}")
    kernel_s = time.perf_counter() - t0
    ds_cls, ds_msg = load_deepspeed() if args.deepspeed else (None, "skipped (--no-deepspeed)")
    if ds_cls is None:
        print(f"NOTE: DeepSpeedCPUAdam {ds_msg}; timing the memopt and torch candidates only.")
    ds_ver = "-"
    if ds_cls is not None:
        import deepspeed

        ds_ver = deepspeed.__version__

    print(f"# CPU AdamW step benchmark, {datetime.date.today().isoformat()}")
    print(f"machine: {cpu_model()}, {os.cpu_count()} logical CPUs; torch {torch.__version__}, deepspeed {ds_ver} "
          f"({ds_msg}); memopt kernel ready in {kernel_s:.1f} s, SIMD width {kernel_simd_width()} fp32; extra cflags "
          f"{os.environ.get('MEMOPT_CPU_ADAM_CFLAGS', '') or 'none'}")
    print(f"median of {args.reps} interleaved rounds after 2 warm-up steps; lr={LR} betas={BETAS} eps={EPS} wd={WD}")
    print(f"Bytes per parameter: read p,g,m,v 16 B + write p,m,v 12 B = {BYTES} B; +2 B fp16 copy = {BYTES_LOWP} B. "
          "Memory bandwidth is measured with 256 MiB tensors inside the same interleaved rounds as the optimizers; "
          "'% bw' is achieved GB/s over the best of those probes in the same section. 'load' is the 1-minute load "
          "average before/after the section (the machine is shared).")
    bw = bandwidth_ops()
    for total in args.sizes:
        for th in threads:
            torch.set_num_threads(th)
            load0 = os.getloadavg()[0]
            rows, gbps = bench_size(int(total), args.tensors, args.reps, ds_cls, args.foreach, args.lowp, bw)
            peak = max(gbps.values())
            print()
            print(f"## {int(total) / 1e6:.0f}M parameters as {args.tensors} flat fp32 tensors {rows[0]['sizes']}, "
                  f"{th} thread(s); load {load0:.1f}/{os.getloadavg()[0]:.1f}")
            print()
            print("memory bandwidth (GB/s): " + ", ".join(f"{k} {v:.1f}" for k, v in gbps.items()))
            print()
            print("| implementation | ms/step (median) | ms (min) | Mparams/s | B/param | GB/s | % bw | "
                  "time ratio vs DeepSpeed | paired ratio |")
            print("|---|---|---|---|---|---|---|---|---|")
            for r in rows:
                ratio = f"{r['ratio']:.3f}" if "ratio" in r else "-"
                paired = f"{r['paired']:.3f}" if "paired" in r else "-"
                print(f"| {r['name']} | {r['ms']:.1f} | {r['min_ms']:.1f} | {r['params_per_s'] / 1e6:.0f} | "
                      f"{r['bytes']} | {r['gbps']:.1f} | {100 * r['gbps'] / peak:.0f}% | {ratio} | {paired} |")
            sys.stdout.flush()
    print()
    print("time ratio = median ms / DeepSpeedCPUAdam's median ms (< 1 is faster); paired ratio = median over rounds "
          "of the per-round ratio. The '+fp16 copy' rows are compared with DeepSpeed's plain step (DeepSpeed "
          f"{ds_ver} has no fused copy-back).")


if __name__ == "__main__":
    main()
