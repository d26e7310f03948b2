"""The report's figures, drawn with matplotlib (Agg backend: no display needed) into PNG files.

Each function draws one figure from the collected runs and returns its path, or ``None`` when no run
recorded what it shows (a sweep of refused jobs has no peaks, a run without metrics no curves).
"""
from __future__ import annotations

import os
import textwrap

from memopt.report.baseline import Ratio
from memopt.report.collect import CATEGORIES, HOST, Run

MiB = 2**20
DASHES = ("-", "--", ":", "-.")
COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optim": "#55a868", "activations": "#c44e52",
          "temp": "#8172b3", "chunks": "#937860", "comm": "#da8bc3",
          "other": "#999999"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _wrap(label: str) -> str:
    return "\n".join(textwrap.wrap(label, 22)) or label


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return path


def _width(n: int) -> float:
    return max(6.0, 1.3 * n + 2.0)


def peak_bytes(runs: list[Run], path: str) -> str | None:
    """Stacked bars of each category's peak, the compute device and the host side by side per run;
    a black tick marks the measured total peak (below the stack: categories peak at different moments)."""
    runs = [r for r in runs if r.peaks("device") or r.peaks(HOST)]
    if not runs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(_width(len(runs)), 4.8))
    w = 0.38
    for i, r in enumerate(runs):
        for side, dx, hatch in (("device", -w / 2, None), (HOST, w / 2, "//")):
            p = r.peaks(side)
            bottom = 0.0
            for c in CATEGORIES:
                v = p.get(c, 0) / MiB
                if v:
                    ax.bar(i + dx, v, w, bottom=bottom, color=COLORS[c], hatch=hatch, edgecolor="white", linewidth=0.5)
                    bottom += v
            if p.get("total"):
                ax.plot([i + dx - w / 2, i + dx + w / 2], [p["total"] / MiB] * 2, color="black", linewidth=2)
    for c in CATEGORIES:
        if any(r.peaks(s).get(c) for r in runs for s in ("device", HOST)):
            ax.bar(0, 0, color=COLORS[c], label=c)
    ax.plot([], [], color="black", linewidth=2, label="measured total peak")
    ax.bar(0, 0, color="white", edgecolor="grey", hatch="//", label="host (right bar)")
    ax.set_xticks(range(len(runs)), [_wrap(r.label) for r in runs], fontsize=8)
    ax.set_ylabel("MiB (each category's peak, max over ranks)")
    ax.set_title("Peak bytes by category (per run: device left, host right)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def throughput(runs: list[Run], path: str) -> str | None:
    """tokens/s (median after warm-up) and MFU of every finished run."""
    runs = [r for r in runs if r.get("tokens_per_s") is not None]
    if not runs:
        return None
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(_width(len(runs)) * 1.4, 4.2))
    x = range(len(runs))
    a.bar(x, [r.get("tokens_per_s") for r in runs], color="#4c72b0")
    a.set_title("tokens/s (median after warm-up)")
    b.bar(x, [100 * (r.get("mfu") or 0) for r in runs], color="#55a868")
    b.set_title("MFU (%)")
    for ax in (a, b):
        ax.set_xticks(list(x), [_wrap(r.label) for r in runs], fontsize=8)
    return _save(fig, path)


def loss_curves(runs: list[Run], path: str) -> str | None:
    """Training loss per logged step, every run overlaid; validation loss as dots."""
    runs = [r for r in runs if any("loss" in m for m in r.metrics)]
    if not runs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, r in enumerate(runs):  # strategies keep the math, so curves often coincide: vary the dashes
        recs = [m for m in r.metrics if "loss" in m]
        (line,) = ax.plot([m["step"] for m in recs], [m["loss"] for m in recs], label=r.label, linewidth=1.4,
                          linestyle=DASHES[i % len(DASHES)])
        val = [m for m in r.metrics if isinstance(m.get("val_loss"), (int, float))]
        if val:
            ax.plot([m["step"] for m in val], [m["val_loss"] for m in val], "o", color=line.get_color(), markersize=4)
    ax.set_xlabel("step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("loss (dots: validation)")
    ax.set_title("Loss")
    ax.legend(fontsize=7)
    return _save(fig, path)


def memory_per_step(runs: list[Run], path: str) -> str | None:
    """Per logged step: peak bytes so far (solid) and live bytes at the log point (dotted), per device."""
    runs = [r for r in runs if any("peak_bytes" in m or "live_bytes" in m for m in r.metrics)]
    if not runs:
        return None
    devices: list[str] = []
    for r in runs:
        for m in r.metrics:
            for d in list(m.get("peak_bytes") or {}) + list(m.get("live_bytes") or {}):
                if d not in devices and any((m.get(k) or {}).get(d) for k in ("peak_bytes", "live_bytes")):
                    devices.append(d)
    devices = sorted(devices, key=lambda d: d == HOST) or ["cpu"]
    plt = _plt()
    fig, axes = plt.subplots(1, len(devices), figsize=(6.5 * len(devices), 4.2), squeeze=False)
    for ax, dev in zip(axes[0], devices):
        for r in runs:
            steps = [m["step"] for m in r.metrics if dev in (m.get("peak_bytes") or {})]
            (line,) = ax.plot(steps, [m["peak_bytes"][dev] / MiB for m in r.metrics if dev in (m.get("peak_bytes") or {})],
                              label=r.label, linewidth=1.2)
            live = [m for m in r.metrics if dev in (m.get("live_bytes") or {})]
            ax.plot([m["step"] for m in live], [m["live_bytes"][dev] / MiB for m in live], ":", color=line.get_color())
        ax.set_title(f"{dev}: peak so far (solid), live at log (dotted)")
        ax.set_xlabel("step")
        ax.set_ylabel("MiB")
        ax.set_ylim(bottom=0)
        ax.xaxis.get_major_locator().set_params(integer=True)
    axes[0][0].legend(fontsize=7)
    return _save(fig, path)


def ratio_bars(ratios: list[Ratio], path: str) -> str | None:
    """tokens/s and peak-byte ratios of each run to its baseline (1.0 = the baseline)."""
    if not ratios:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(_width(len(ratios)), 4.2))
    w = 0.27
    series = [("tokens/s", "tokens_per_s", "#4c72b0"), ("device peak", "peak_device", "#c44e52"),
              ("host peak", "peak_host", "#937860")]
    for k, (name, attr, color) in enumerate(series):
        ax.bar([i + (k - 1) * w for i in range(len(ratios))], [getattr(q, attr) or 0 for q in ratios], w, label=name, color=color)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(ratios)), [_wrap(f"{q.run.label} / {q.base.label}") for q in ratios], fontsize=7)
    ax.set_ylabel("ratio to baseline")
    ax.set_title("Against the baseline (run / baseline)")
    ax.legend(fontsize=7)
    return _save(fig, path)


FIGURES = (
    ("peak_bytes", "Peak bytes by category, device and host", peak_bytes),
    ("throughput", "tokens/s and MFU", throughput),
    ("loss", "Loss curves", loss_curves),
    ("memory_per_step", "Memory per step", memory_per_step),
)


def draw_all(runs: list[Run], ratios: list[Ratio], out_dir: str) -> list[tuple[str, str]]:
    """Every figure that has data, as (caption, path) under ``out_dir/figures``."""
    fig_dir = os.path.join(out_dir, "figures")
    os.makedirs(fig_dir, exist_ok=True)
    out = []
    for name, caption, fn in FIGURES:
        p = fn(runs, os.path.join(fig_dir, f"{name}.png"))
        if p:
            out.append((caption, p))
    p = ratio_bars(ratios, os.path.join(fig_dir, "ratios.png"))
    if p:
        out.append(("Ratios against the baseline", p))
    if not out and not os.listdir(fig_dir):
        os.rmdir(fig_dir)
    return out
