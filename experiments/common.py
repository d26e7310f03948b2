"""Formatting shared by the benchmark scripts: MiB, markdown tables, the header line naming the machine."""
from __future__ import annotations

import datetime
import os
import platform


def mib(b) -> str:
    return f"{b / 2**20:,.1f}"


def table(head: list, rows: list[list]) -> str:
    """A markdown table, columns padded to their widest cell."""
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]

    def line(r):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def machine_line() -> str:
    """``date: ... machine: <CPU model>, <cores> cores, CUDA|CPU only  torch <version>``."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"date: {datetime.date.today().isoformat()}  machine: {cpu}, {os.cpu_count()} cores, "
            f"{'CUDA' if torch.cuda.is_available() else 'CPU only'}  torch {torch.__version__}")
