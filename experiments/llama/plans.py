"""Issue #31's questions, answered by the planner: does Llama-3-8B full fine-tuning or LoRA fit one 24 GB
GPU, one A100 80G, an 8x H100 node, and Llama-3-70B an 8x H100 node; and how fast a step is, planned.

    python experiments/llama/plans.py            # every row (about a minute here)
    python experiments/llama/plans.py --only 70B

Each row is one ``python -m memopt.train ... trainer.mode=plan`` command (printed as typed), planned on
fake tensors: nothing model-sized is allocated and no weights are read. Fine-tuning rows use 2,048
tokens a sequence (a common fine-tuning length); the node rows keep Llama 3's 8,192.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, REPO)

from experiments.common import machine_line, table  # noqa: E402

B8, B70 = ["model=llama3_8b"], ["model=llama3_70b"]
FT = ["model.seq_len=2048"]
LORA_BF16 = "strategy.bf16.params=bf16"  # frozen base weights stored in bf16: 2 B/param
ROWS = [
    # (name, question, overrides)
    ("8B full, 1x 24 GB", "Llama-3-8B full fine-tuning on one 24 GB GPU",
     [*B8, *FT, "+strategy=[hybrid_adam_bf16,ckpt]", "hardware=rtx4090", "trainer.micro_batch_size=1"]),
    ("8B LoRA, 1x 24 GB", "Llama-3-8B LoRA on one 24 GB GPU",
     [*B8, *FT, "+strategy=[bf16,lora,ckpt]", LORA_BF16, "hardware=rtx4090", "trainer.micro_batch_size=1"]),
    ("8B full, 1x A100 80G", "Llama-3-8B full fine-tuning on one A100 80G",
     [*B8, *FT, "+strategy=[hybrid_adam_bf16,ckpt]", "hardware=a100_80g", "trainer.nproc_per_node=1",
      "trainer.micro_batch_size=4"]),
    ("8B LoRA, 1x A100 80G", "Llama-3-8B LoRA on one A100 80G",
     [*B8, *FT, "+strategy=[bf16,lora]", LORA_BF16, "hardware=a100_80g", "trainer.nproc_per_node=1",
      "trainer.micro_batch_size=4"]),
    ("8B full, 8x H100", "Llama-3-8B full fine-tuning on 8x H100 (FSDP2, torchtitan's setting)",
     [*B8, "engine=fsdp2", "+strategy=[bf16,zero3,ckpt]", "hardware=h100_sxm", "trainer.nproc_per_node=8",
      "trainer.micro_batch_size=2"]),
    ("8B LoRA, 8x H100", "Llama-3-8B LoRA on 8x H100",
     [*B8, "+strategy=[bf16,lora,ckpt]", LORA_BF16, "hardware=h100_sxm", "trainer.nproc_per_node=8",
      "trainer.micro_batch_size=2"]),
    ("70B full, 8x H100", "Llama-3-70B full fine-tuning on 8x H100 (ZeRO-3 with the optimizer on the host)",
     [*B70, "+strategy=[bf16,zero3,cpu_offload,ckpt]", "hardware=h100_sxm", "trainer.nproc_per_node=8",
      "trainer.micro_batch_size=1"]),
    ("70B LoRA, 8x H100", "Llama-3-70B LoRA on 8x H100 (frozen bf16 base sharded by ZeRO-3)",
     [*B70, "+strategy=[bf16,zero3,lora,ckpt]", LORA_BF16, "hardware=h100_sxm", "trainer.nproc_per_node=8",
      "trainer.micro_batch_size=1"]),
]


def plan(overrides: list[str]) -> tuple[dict, float]:
    """plan.json of one command, planned in a subprocess as a user runs it, and its wall time."""
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "memopt.train", *overrides, "trainer.mode=plan", "logger=none",
                        f"hydra.run.dir={d}"], cwd=REPO, capture_output=True, text=True, timeout=900)
        with open(os.path.join(d, "plan.json")) as f:
            return json.load(f), time.perf_counter() - t0


def gib(b) -> str:
    return f"{b / 2**30:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="rows whose name contains this")
    args = ap.parse_args()
    print(machine_line())
    rows = []
    for name, question, ov in ROWS:
        if args.only not in name:
            continue
        p, secs = plan(ov)
        print(f"{question}:\n  python -m memopt.train {' '.join(ov)} trainer.mode=plan", flush=True)
        if "peak_bytes" not in p:
            rows.append([name, "no", "-", "-", "-", p.get("error", "")[:60], f"{secs:.0f}"])
            continue
        dev = max(r.get("device", {}).get("total", 0) for r in p["peak_bytes"].values())
        st = p["step_time"]
        tok = p["micro_batch_size"] * p["grad_accum"] * (2048 if "model.seq_len=2048" in ov else 8192)
        rows.append([name, "yes" if p["fits"] else "no", f"{gib(dev)} / {p['hardware']['device_memory_gb']:g}",
                     f"{gib(p['node_host_bytes'])} / {p['hardware']['host_memory_gb']:g}",
                     f"{st['total_s']:.2f} ({st['dominant']})" + ("" if st.get("optimizer_s") is not None else " +host Adam"),
                     f"{tok / st['total_s']:,.0f}", f"{secs:.0f}"])
    print(table(["question", "fits", "device peak GiB / GPU", "node host GiB", "step s (dominant)",
                 "tokens/s/GPU", "plan s"], rows))


if __name__ == "__main__":
    main()
