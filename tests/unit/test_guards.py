"""memopt.guards: what stops a run between two steps (the signal side; divergence: tests/e2e)."""
from __future__ import annotations


def test_a_launcher_that_died_is_seen_while_still_a_zombie(monkeypatch):
    """The parent-death signal finds the launcher exited but not yet reaped (a zombie), while getppid()
    still names it: that counts as gone; a live parent does not."""
    import os
    import subprocess
    import time

    from memopt.guards import parent_gone

    assert not parent_gone(os.getppid())
    child = subprocess.Popen(["true"])  # exits at once; not reaped until wait()
    deadline = time.time() + 10
    while time.time() < deadline:
        with open(f"/proc/{child.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.01)
    monkeypatch.setattr(os, "getppid", lambda: child.pid)
    assert parent_gone(child.pid)
    child.wait()
