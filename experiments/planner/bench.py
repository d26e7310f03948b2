"""The largest GPT (width fixed, depth searched) that fits a node, per strategy, as planned.

    python experiments/planner/bench.py [--hardware v100_patrickstar] [--nproc 8] [--micro-batch 8]
    python experiments/planner/bench.py --nproc 1                            # one V100 32 GB + 240 GB host
    python experiments/planner/bench.py --hardware h200 --host-gb 1536 --nproc 1 --width 8192   # one H200 + 1.5 TB

Every row is the planner's bisection over model.n_layer (memopt/planner/search.py: largest_model; the
chunk rows then plan the 12 depths above its answer, their fit not being monotone in depth) on
the same width, sequence length, micro-batch and world: memopt's chunk engine with Hybrid Adam,
memopt's chunk engine alone (optimizer on the host), memopt's zero3 + cpu_offload (parameters on the
host too), and DeepSpeed ZeRO-3-Offload planned under DeepSpeed's own rules (its model-state
estimators + memopt's fake step for activations). Nothing is trained; fp16 with activation
checkpointing everywhere, as in the PatrickStar and ZeRO-Offload tables. Deep probes are planned from
shallow ones where the planner's checks allow (memopt/planner/extrapolate.py); the last column says how.
Each row ends with its reading at the limit: bytes per parameter on the host (node) and on one device,
and the host bytes by category.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from experiments.common import machine_line, table  # noqa: E402

STRATEGIES = {
    # the chunk engine's chunk size, communication form and warm-up share are its own
    # (engines/chunk/defaults.py); its optimizer placement is the plan's (planner/placement.py)
    "memopt hybrid_adam (chunk)": ["+strategy=[hybrid_adam,ckpt]"],
    "memopt chunk (host Adam)": ["+strategy=[chunk,fp16,ckpt]"],
    "memopt zero3 + cpu_offload": ["+strategy=[fp16,zero3,cpu_offload,ckpt]"],
    "DeepSpeed ZeRO-3-Offload (its rules)": ["engine=deepspeed", "+strategy=[fp16,zero3,cpu_offload,ckpt]"],
}
# the chunk engine's fit is not monotone in depth (largest_model's docstring): its rows also plan the
# SCAN depths above the bisection's answer
SCAN = 12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hardware", default="v100_patrickstar")
    ap.add_argument("--host-gb", type=float, default=None, help="hardware.host_memory_gb (default: the profile's)")
    ap.add_argument("--width", type=int, default=4096, help="model.d_model (heads: width / 128)")
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--hi", type=int, default=320)
    ap.add_argument("--scan", type=int, default=SCAN, help="chunk rows: depths planned above the bisection's answer")
    ap.add_argument("--only", default=None, help="run one row (a key of STRATEGIES, substring)")
    args = ap.parse_args()
    from memopt.api import compose_config
    from memopt.config import to_dataclass
    from memopt.memory.hardware import resolve_hardware
    from memopt.planner.plan import GiB
    from memopt.planner.search import largest_model

    import torch

    base = ["model=gpt_10b", "data=synthetic", "logger=none", f"hardware={args.hardware}", f"trainer.nproc_per_node={args.nproc}",
            f"trainer.micro_batch_size={args.micro_batch}", "trainer.eval_every=0"]  # model.pt saved (streamed), as by default
    if args.host_gb is not None:
        base.append(f"hardware.host_memory_gb={args.host_gb:g}")
    if args.width != 4096:
        base += [f"model.d_model={args.width}", f"model.n_head={args.width // 128}"]
    hw = resolve_hardware(to_dataclass(compose_config(base)).hardware, torch.device("cpu"))
    print(machine_line())
    rows = []
    for name, extra in STRATEGIES.items():
        if args.only and args.only not in name:
            continue
        t0 = time.perf_counter()
        scan = args.scan if any("chunk" in o or "hybrid_adam" in o for o in extra) else 0
        n, plan, tried = largest_model([*base, *extra], hw, hi=args.hi, scan=scan)
        secs = time.perf_counter() - t0
        if plan is None:
            rows.append([name, "none fits", "-", "-", "-", "-", "-", f"{secs:.0f}"])
            continue
        dev = max(p["device"]["total"] for p in plan["peak_bytes"].values())
        st = plan["step_time"]
        how = plan.get("method", {}).get("0", "exact").split(" (")[0]  # extrapolated from n_layer=a,b | exact
        rows.append([name, n, f"{plan['params'] / 1e9:.1f}", f"{dev / GiB:.1f}", f"{plan['node_host_bytes'] / GiB:.0f}",
                     f"{st['total_s']:.1f} ({st['dominant']})", how, f"{secs:.0f} ({len(tried)} plans)"])
        print(name, [(n, ok, round(t, 1)) for n, ok, t in tried], flush=True)
        print("  " + reading(plan), flush=True)
    print(f"hardware {hw.name}: {hw.devices_per_node} x {hw.device_memory_gb} GiB devices, {hw.host_memory_gb} GiB host; "
          f"{args.nproc} ranks, micro-batch {args.micro_batch}, seq_len 1024, width {args.width}")
    print(table(["strategy", "largest n_layer", "params (B)", "device peak GiB", "node host GiB", "step s (dominant)",
                 "largest planned as", "search s"], rows))


def reading(plan: dict) -> str:
    """Where the bytes are at the limit: the node's host and one device, in bytes per parameter, which
    memory has the least left, the host by category (the worst simulated rank, GiB), and the placement."""
    P, G = plan["params"], 2**30
    worst = max(plan["peak_bytes"], key=lambda r: plan["peak_bytes"][r].get("host", {}).get("total", 0))
    host = {k: v for k, v in plan["peak_bytes"][worst].get("host", {}).items() if v and k != "total"}
    dev = max(p["device"]["total"] for p in plan["peak_bytes"].values())
    ranks = plan["ranks_per_node"]
    fit = plan["fit"]
    binds = min(fit, key=lambda k: fit[k]["margin"] / fit[k]["limit"])
    place = plan.get("placement")
    return (f"reading: host {plan['node_host_bytes'] / P:.2f} B/param of the node's host ({plan['node_host_bytes'] / G:.1f} of "
            f"{fit['host']['limit'] / G:.0f} GiB), device {dev * ranks / P:.2f} B/param over {ranks} device(s) ({dev / G:.2f} GiB "
            f"each of {fit['device']['limit'] / G:.0f}); least left: {binds} ({fit[binds]['margin'] / G:.2f} GiB); rank {worst}'s host: "
            + ", ".join(f"{k} {v / G:.2f}" for k, v in host.items())
            + (f"; optimizer groups on each device from step 0: {place['device_groups']} (warm-up's own: {place['warmup_groups']})"
               if place else ""))


if __name__ == "__main__":
    main()
