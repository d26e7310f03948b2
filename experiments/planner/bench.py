"""The largest GPT (width 4096, depth searched) that fits PatrickStar's node, per strategy, as planned.

    python experiments/planner/bench.py [--hardware v100_patrickstar] [--nproc 8] [--micro-batch 8]

Every row is the planner's bisection over model.n_layer (memopt/planner/search.py: largest_model; the
chunk rows then plan the 12 depths above its answer, their fit not being monotone in depth) on
the same width, sequence length, micro-batch and world: memopt's chunk engine with Hybrid Adam,
memopt's chunk engine alone (optimizer on the host), memopt's zero3 + cpu_offload (parameters on the
host too), and DeepSpeed ZeRO-3-Offload planned under DeepSpeed's own rules (its model-state
estimators + memopt's fake step for activations). Nothing is trained; fp16 with activation
checkpointing everywhere, as in the PatrickStar and ZeRO-Offload tables. Deep probes are planned from
shallow ones where the planner's checks allow (memopt/planner/extrapolate.py); the last column says how.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from experiments.common import machine_line, table  # noqa: E402

STRATEGIES = {
    # the chunk engine's communication form and warm-up share are its own (engines/chunk/defaults.py)
    "memopt hybrid_adam (chunk)": ["+strategy=[hybrid_adam,ckpt]"],
    # chunks of the embedding's size (the smallest the search allows): finer Hybrid Adam placement,
    # whose groups the plan puts on the device before step 0 (planner/placement.py)
    "memopt hybrid_adam (chunk), chunk = embedding": ["+strategy=[hybrid_adam,ckpt]", "strategy.chunk.chunk_size=206045184"],
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
        print(name, tried, flush=True)
    print(f"hardware {hw.name}: {hw.devices_per_node} x {hw.device_memory_gb} GiB devices, {hw.host_memory_gb} GiB host; "
          f"{args.nproc} ranks, micro-batch {args.micro_batch}, seq_len 1024, width 4096")
    print(table(["strategy", "largest n_layer", "params (B)", "device peak GiB", "node host GiB", "step s (dominant)",
                 "largest planned as", "search s"], rows))


if __name__ == "__main__":
    main()
