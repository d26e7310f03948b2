"""plan.png's limits: each bar is drawn against its own memory's limit from the hardware profile, and the
axis follows the bars (a small plan on a large device is not a flat line)."""
from __future__ import annotations

from memopt.planner.figure import GiB, bar_limits, plan_figure


def _plan(device_is_host: bool) -> dict:
    hw = {"name": "x", "device_memory_gb": 32, "host_memory_gb": 240, "device_is_host": device_is_host}
    cats = {"params": 3 * 2**20, "activations": 5 * 2**20, "total": 7 * 2**20}
    return {"hardware": hw, "ranks_per_node": 8, "model": "m", "strategy": [], "engine": "memopt", "fits": True,
            "peak_bytes": {"0": {"device": cats, "host": {"optim": 2**20, "total": 2**20}}, "7": {"device": cats}}}


def test_each_bar_has_its_memorys_limit():
    got = {label: (lim, name) for label, _, lim, name in bar_limits(_plan(False))}
    assert got["rank 0\ndevice"] == (32 * GiB, "device") and got["rank 7\ndevice"] == (32 * GiB, "device")
    assert got["rank 0\nhost"] == (30 * GiB, "host / 8 rank(s)")  # 240 GB shared by the node's 8 ranks
    assert {lim for _, _, lim, _ in bar_limits(_plan(True))} == {30 * GiB}  # one RAM: its share per rank


def test_figure_axis_follows_small_bars(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    tops = []
    monkeypatch.setattr(plt, "close", lambda fig: tops.append(fig.axes[0].get_ylim()[1]))
    plan_figure(_plan(False), str(tmp_path / "plan.png"))
    assert (tmp_path / "plan.png").stat().st_size > 1000
    assert 8 <= tops[0] <= 8 * 1.25  # MiB: the 8 MiB of stacked peaks fill the axis; the 32 GiB limit is written, not drawn
