#!/bin/bash
# Issue #30's check through the CLI: B = 25% of plain DDP's measured device peak per rank (gpt_small, 2 ranks),
# then memopt's and DeepSpeed's +strategy=auto at that budget, each trained. Usage: experiments/fixed_budget/cli_check.sh OUT_DIR
set -e
OUT=${1:-outputs/fixed_budget}
mkdir -p "$OUT" && cd "$OUT"
PY=${PY:-python}
COMMON="model=gpt_small trainer.nproc_per_node=2 logger=none trainer.progress_bar=false trainer.eval_every=0"
rm -rf ddp auto_memopt auto_ds
/usr/bin/env time -f "%e s" $PY -m memopt.train $COMMON +strategy=ddp trainer.max_steps=4 hydra.run.dir=$PWD/ddp > ddp.log 2>&1
B=$($PY -c "import json;s=json.load(open('ddp/summary.json'));print(round(0.25*max(v['cpu']['total'] for v in s['peak_bytes'].values())/2**30,4))")
echo "B=$B" > B.txt
/usr/bin/env time -f "%e s" $PY -m memopt.train $COMMON +strategy=auto hardware.device_memory_gb=$B trainer.max_steps=8 hydra.run.dir=$PWD/auto_memopt > auto_memopt.log 2>&1
/usr/bin/env time -f "%e s" $PY -m memopt.train $COMMON engine=deepspeed +strategy=auto hardware.device_memory_gb=$B trainer.max_steps=8 hydra.run.dir=$PWD/auto_ds > auto_ds.log 2>&1
$PY - <<'PY'
import json
budget = float(open("B.txt").read().split("=")[1]) * 2**30
print(f"budget per rank: {budget / 2**20:.1f} MiB (25% of ddp's measured peak)")
for d in ("ddp", "auto_memopt", "auto_ds"):
    s = json.load(open(f"{d}/summary.json"))
    peaks = [v["cpu"]["total"] for v in s["peak_bytes"].values()]
    print(f"{d:12} {s['status']:4} {'+'.join(s['strategy']):26} {s['engine']:9} {s['tokens_per_s']:8.0f} tokens/s  "
          f"peak/rank {max(peaks) / 2**20:7.1f} MiB{'' if d == 'ddp' else ('  <= budget' if max(peaks) <= budget else '  OVER')}")
PY
