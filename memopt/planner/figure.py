"""plan.png: stacked bars of every simulated rank's device and host bytes by category, each bar with its
own memory's limit.

The axis follows the bars, not the limits: a 0.6 GiB plan on an 80 GiB device drawn to the limit is a
flat line. A limit within 2.5x of the tallest bar is drawn over its bar (how near it is matters);
a limit further away is written above the bar instead (``limit 80 GiB ^``).
"""
from __future__ import annotations

from memopt.memory.tracker import CATEGORIES

GiB, MiB = 2**30, 2**20
LIMIT_SHOWN = 2.5  # draw a limit on the axis when it is at most this many times the tallest bar


def bar_limits(plan: dict) -> list[tuple[str, dict, float, str]]:
    """(label, categories, limit in bytes, limit's name) per simulated rank and memory."""
    hw, per_node = plan["hardware"], plan["ranks_per_node"]
    host_share = hw["host_memory_gb"] * GiB / per_node
    out = []
    for r, devs in plan["peak_bytes"].items():
        for dev, cats in devs.items():
            if hw["device_is_host"]:
                limit, name = host_share, f"RAM / {per_node} rank(s)"
            elif dev == "host":
                limit, name = host_share, f"host / {per_node} rank(s)"
            else:
                limit, name = hw["device_memory_gb"] * GiB, "device"
            out.append((f"rank {r}\n{dev}", cats, limit, name))
    return out


def plan_figure(plan: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = bar_limits(plan)
    tallest = max([max(v.get("total", 0), sum(v.get(c, 0) for c in CATEGORIES)) for _, v, _, _ in bars] + [1])
    shown = [lim for _, _, lim, _ in bars if lim <= LIMIT_SHOWN * tallest]
    unit, uname = (GiB, "GiB") if max([tallest, *shown]) >= GiB else (MiB, "MiB")
    top = max([tallest, *shown]) * 1.25 / unit

    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(bars) + 2), 4.2))
    xs = list(range(len(bars)))
    bottom = [0.0] * len(bars)
    for cat in CATEGORIES:
        h = [v.get(cat, 0) / unit for _, v, _, _ in bars]
        if any(h):
            ax.bar(xs, h, bottom=bottom, label=cat, width=0.6)
            bottom = [b + x for b, x in zip(bottom, h)]
    ax.scatter(xs, [v.get("total", 0) / unit for _, v, _, _ in bars], marker="_", s=900, color="black", zorder=3,
               label="peak of the sum")
    labelled = set()
    for x, (_, _, lim, name) in zip(xs, bars):
        style = {"color": "red" if name == "device" or name.startswith("RAM") else "purple", "ls": "--", "lw": 1.5}
        if lim / unit <= top:
            label = None if name in labelled else f"{name} limit"
            labelled.add(name)
            ax.hlines(lim / unit, x - 0.42, x + 0.42, zorder=4, label=label, **style)
        else:
            ax.annotate(f"{name} limit\n{lim / GiB:,.0f} GiB ^", (x, top * 0.97), ha="center", va="top", fontsize=7,
                        color=style["color"])
    ax.set_ylim(0, top)
    ax.set_xticks(xs, [b[0] for b in bars])
    ax.set_ylabel(f"peak {uname} (categories' peaks stacked)")
    hw = plan["hardware"]
    ax.set_title(f"{plan['model']}: {'+'.join(plan['strategy']) or 'plain'} ({plan['engine']}) on {hw['name']}: "
                 + ("fits" if plan["fits"] else "does not fit"), fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
