"""Time the chunk engine's optimizer step alone on the host: gpt_small, fp16, every parameter chunk
and optimizer group on the host (the warm-up's placement), synthetic gradients written where the
engine keeps them (the payload under gradient reuse, else the companion), median of --steps steps.

    PYTHONPATH=<a memopt tree> python experiments/chunk/host_step_time.py --steps 9

Run it against two trees (e.g. ``git archive <commit> memopt conf | tar -x -C /tmp/old``) one after
the other, several rounds, to compare host steps on the same machine and hour.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    from memopt.api import compose_config
    from memopt.config import to_dataclass
    from memopt.engines import build_engine
    from memopt.memory.tracker import NullTracker
    from memopt.parallel import setup, teardown

    cfg = to_dataclass(compose_config(["model=gpt_small", "+strategy=hybrid_adam", "strategy.chunk.device_budget_gb=0.2",
                                       "logger=none", "strategy.chunk.chunk_size=1051648"]))
    dev = torch.device("cpu")
    dims = setup(dev, cfg.parallel)
    try:
        eng = build_engine(cfg, dev, dims, NullTracker())
        opt, mgr = eng.optimizer, eng.mgr
        gen = torch.Generator().manual_seed(0)
        times = []
        for _ in range(args.steps):
            for c in mgr.chunks:
                g = torch.randn(c.numel, generator=gen) * 1e-2
                if getattr(mgr, "reuse", False):
                    c.data.copy_(g)
                    c.grad_in_payload = True
                else:
                    c.alloc_grad().copy_(g)
            t0 = time.perf_counter()
            assert not opt.step(1e-4).skipped
            times.append(time.perf_counter() - t0)
        print(f"{args.label} host step s: median {statistics.median(times):.4f}, all {[round(t, 4) for t in times]}, "
              f"threads {torch.get_num_threads()}, CPUAdamW {opt._cpu_adam.impl}")
    finally:
        teardown()


if __name__ == "__main__":
    main()
