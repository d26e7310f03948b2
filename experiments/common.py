"""Shared by the benchmark scripts: MiB, markdown tables, the header line naming the machine, and
where the runs go (W&B group per benchmark, run directories under outputs/bench/<name>/)."""
from __future__ import annotations

import datetime
import os
import platform

from memopt.memory.hardware import cpu_info  # the package's reading of /proc/cpuinfo (first processor)


def mib(b) -> str:
    return f"{b / 2**20:,.1f}"


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (no ties expected among measured times)."""
    def ranks(x):
        order = sorted(range(len(x)), key=x.__getitem__)
        r = [0.0] * len(x)
        for i, j in enumerate(order):
            r[j] = float(i)
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    if n < 2:
        return float("nan")
    d2 = sum((x - y) ** 2 for x, y in zip(ra, rb))
    return 1 - 6 * d2 / (n * (n * n - 1))


def widest_misordered_pair(planned: list[float], measured: list[float]) -> str:
    """Of the pairs whose planned order is the reverse of their measured one, the pair planned furthest apart: its
    planned and measured gaps, as a clause to append to a Spearman line; empty when no pair is reversed. Why: a
    plan within ~10% cannot order two steps planned 0.1% apart, and a Spearman over 2 or 3 rows cannot tell that
    from a real miss."""
    worst = None
    for i in range(len(planned)):
        for j in range(i + 1, len(planned)):
            if (planned[i] - planned[j]) * (measured[i] - measured[j]) < 0:
                gaps = (abs(planned[i] - planned[j]) / min(planned[i], planned[j]),
                        abs(measured[i] - measured[j]) / min(measured[i], measured[j]))
                worst = max(worst or gaps, gaps)
    if worst is None:
        return ""
    return f"; misordered pairs planned at most {worst[0]:.1%} apart (that pair measured {worst[1]:.1%} apart)"


def table(head: list, rows: list[list]) -> str:
    """A markdown table, columns padded to their widest cell."""
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]

    def line(r):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def cpu_has_bf16_matmul() -> bool:
    """True when the CPU has bf16 matrix instructions (AVX-512-BF16 or AMX-BF16). Without them torch
    emulates bf16/fp16 matmuls, ~40x slower than fp32 (``hardware=auto`` measured 0.0019 vs
    0.078 TFLOP/s on an AVX2 CPU), so a CPU benchmark should then run in fp32."""
    flags = set(cpu_info().get("flags", "").split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def machine_line() -> str:
    """``date: ... machine: <CPU model> (family f model m; <SIMD flags>), <cores> cores, CUDA|CPU only  torch <version>``.

    The CPU family/model and SIMD flags are there because the same model name covers CPUs whose
    bf16/fp16 matmuls differ by 10x or more (AVX-512 BF16 vs an AVX2 fallback)."""
    import torch

    cpu = platform.processor() or platform.machine()
    info = cpu_info()
    cpu = info.get("model name", cpu)
    if info:
        flags = set(info.get("flags", "").split())
        simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16") if f in flags] or ["no avx2"]
        cpu += f" (family {info.get('cpu family', '?')} model {info.get('model', '?')}; {', '.join(simd)})"
    return (f"date: {datetime.date.today().isoformat()}  machine: {cpu}, {os.cpu_count()} cores, "
            f"{'CUDA' if torch.cuda.is_available() else 'CPU only'}  torch {torch.__version__}")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wandb_overrides(name: str) -> list[str]:
    """Log every job of benchmark ``name`` to W&B in the group ``bench-<name>``: online with
    credentials, offline otherwise (the run directory then holds ``wandb/offline-run-*``). The
    trainer logs on rank 0 after a step's clock has stopped, so this does not enter the timings."""
    return ["logger=wandb", f"logger.group=bench-{name}"]


def bench_dir(name: str) -> str:
    """A fresh directory for this invocation's runs, ``outputs/bench/<name>/<date>_<time>`` under the
    repository (git-ignored; kept, so that offline W&B runs can be synced afterwards)."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    path = os.path.join(REPO, "outputs", "bench", name, stamp)
    n = 1
    while os.path.exists(path):  # two invocations within a second
        n += 1
        path = os.path.join(REPO, "outputs", "bench", name, f"{stamp}-{n}")
    os.makedirs(path)
    return path


def planned_step_time(overrides: list[str], nproc: int = 2) -> dict:
    """The plan's ``step_time`` of ``overrides`` on ``nproc`` ranks, as ``trainer.mode=plan`` makes it (this CPU's
    rates probed once per process and model, then cached: plans made in one process share one probe)."""
    from memopt.config import compose_config, to_dataclass, validate
    from memopt.gate import hardware
    from memopt.planner.plan import make_plan

    cfg = to_dataclass(compose_config([*overrides, f"trainer.nproc_per_node={nproc}", "trainer.mode=plan"]))
    validate(cfg)
    return make_plan(cfg, hardware(cfg, step_rates=True))["step_time"]
