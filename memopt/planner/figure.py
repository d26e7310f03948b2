"""plan.png: stacked bars of every simulated rank's device and host bytes by category, the limits drawn."""
from __future__ import annotations

from memopt.memory.tracker import CATEGORIES

GiB = 2**30


def plan_figure(plan: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"rank {r}\n{dev}", v) for r, devs in plan["peak_bytes"].items() for dev, v in devs.items()]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(bars) + 2), 4.2))
    xs = range(len(bars))
    bottom = [0.0] * len(bars)
    for cat in CATEGORIES:
        h = [v.get(cat, 0) / GiB for _, v in bars]
        if any(h):
            ax.bar(xs, h, bottom=bottom, label=cat, width=0.6)
            bottom = [b + x for b, x in zip(bottom, h)]
    ax.scatter(list(xs), [v.get("total", 0) / GiB for _, v in bars], marker="_", s=900, color="black", zorder=3,
               label="peak of the sum")
    hw = plan["hardware"]
    if hw["device_is_host"]:
        ax.axhline(hw["host_memory_gb"] / plan["ranks_per_node"], color="red", ls="--",
                   label=f"RAM / {plan['ranks_per_node']} rank(s) ({hw['host_memory_gb'] / plan['ranks_per_node']:.1f} GiB)")
    else:
        ax.axhline(hw["device_memory_gb"], color="red", ls="--", label=f"device limit ({hw['device_memory_gb']:g} GiB)")
        ax.axhline(hw["host_memory_gb"] / plan["ranks_per_node"], color="purple", ls=":",
                   label=f"host / {plan['ranks_per_node']} rank(s)")
    ax.set_xticks(list(xs), [b[0] for b in bars])
    ax.set_ylabel("peak GiB (categories' peaks stacked)")
    ax.set_title(f"{plan['model']}: {'+'.join(plan['strategy']) or 'plain'} ({plan['engine']}) on {hw['name']}: "
                 + ("fits" if plan["fits"] else "does not fit"), fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
