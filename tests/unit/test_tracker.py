"""The dispatch-mode tracker against allocations whose sizes are known by construction."""
from __future__ import annotations

import pytest
import torch

from memopt.memory.tracker import MemoryTracker


def test_counts_live_and_peak_bytes():
    tr = MemoryTracker("cpu")
    with tr:
        with tr.category("activations"):
            a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
            b = torch.zeros(500, dtype=torch.float16)  # 1000 bytes
            v = a.view(10, 100)  # a view allocates nothing
        assert tr.live["cpu"]["activations"] == 5000
        del a, v
        assert tr.live["cpu"]["activations"] == 1000
        with tr.category("temp"):
            c = torch.ones(250, dtype=torch.float64)  # 2000 bytes
    p = tr.peaks()["cpu"]
    assert p["activations"] == 5000 and p["temp"] == 2000 and p["total"] == 5000
    del b, c
    assert tr.live_bytes("cpu") == 0


def test_categories_params_grads_optim_and_host():
    model = torch.nn.Linear(100, 10, bias=False)  # 1000 fp32 = 4000 bytes
    tr = MemoryTracker("cpu")
    with tr:
        tr.register_module(model)
        with tr.category("activations"):
            y = model(torch.randn(4, 100)).sum()
        with tr.category("temp"):
            y.backward()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with tr.category("optim"):
            opt.step()
        with tr.host_scope():
            h = torch.empty(300, dtype=torch.uint8)
    assert tr.live["cpu"]["params"] == 4000
    assert tr.live["cpu"]["grads"] == 4000  # re-tagged by the post-accumulate-grad hook
    assert tr.live["cpu"]["optim"] == 4000  # momentum buffer
    assert tr.live["host"]["other"] == 300
    del h
    assert tr.live["host"]["other"] == 0


def test_peak_window_reset():
    tr = MemoryTracker("cpu")
    with tr:
        x = torch.empty(1000)
        del x
        tr.reset_peaks()
        y = torch.empty(10)
    assert tr.peaks()["cpu"]["total"] == 40
    del y


def test_placed_at_exit_counts_survivors_on_their_final_device_from_their_birth():
    """A library allocates a host buffer and a device scratch inside the block; the host buffer is
    re-tagged only at the end: the block's device peak is the scratch alone, the host holds the buffer
    from its birth (as ``other`` until its re-tag). A scratch freed inside the block stays where it was born."""
    tr = MemoryTracker("cpu")
    with tr:
        old = torch.empty(100)  # 400 bytes on the device before the block
        with tr.placed_at_exit():
            host_buf = torch.empty(1000)  # 4000 bytes, host memory in truth
            scratch = torch.empty(500)  # 2000 bytes, freed inside the block
            del scratch
            tr.register(old, "params")  # a re-tag of an older storage happens in order
            tr.register(host_buf, "optim", device="host")
    p = tr.peaks()
    assert p["cpu"]["total"] == 400 + 2000 and p["cpu"]["other"] == 2400 and p["cpu"]["params"] == 400
    assert p["host"]["optim"] == 4000 and p["host"]["other"] == 4000 and p["host"]["total"] == 4000
    assert tr.live["cpu"]["params"] == 400 and tr.live["host"]["optim"] == 4000 and tr.live["cpu"]["other"] == 0
    del host_buf, old


def test_a_device_budget_inside_placed_at_exit_is_judged_where_storages_end():
    """Inside the block a library's host buffer counts on the device until its re-tag: a budget under it must not end
    the run there (DeepSpeed's offload buffers on one CPU rank took a run that fits to ``oom`` at ``initialize``).
    The budget is judged on the replay at the exit: host buffers pass, device bytes over it raise there."""
    from memopt.memory.tracker import DeviceBudgetExceeded

    tr = MemoryTracker("cpu", budget=3000)
    with tr:
        with tr.placed_at_exit():
            host_buf = torch.empty(1000)  # 4000 bytes: over the budget until it is re-tagged as host
            scratch = torch.empty(500)  # 2000 bytes on the device: under it
            tr.register(host_buf, "optim", device="host")
        assert tr.peaks()["cpu"]["total"] == 2000 and tr.peaks()["host"]["total"] == 4000
        with pytest.raises(DeviceBudgetExceeded, match=r"3200 B live > hardware.device_memory_gb = 3000 B, crossed by 1200 B"
                                                       r" of other \(largest category other: 3200 B\)"):
            with tr.placed_at_exit():
                more = torch.empty(300)  # 2000 + 1200 bytes on the device at the exit's replay
                del scratch  # freed before the exit: the message reads the categories at the crossing
    del host_buf, more
    tr = MemoryTracker("cpu", budget=3000)  # nested: the inner block is the outer one's; an error inside still counts
    with tr:
        with pytest.raises(ValueError), tr.placed_at_exit():
            with tr.placed_at_exit():
                buf = torch.empty(1000)
            tr.register(buf, "optim", device="host")
            raise ValueError("the library failed")
        assert tr.peaks()["host"]["optim"] == 4000 and tr.peaks()["cpu"]["total"] == 0 and tr._window is None
    del buf
