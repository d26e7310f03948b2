"""Every ``test_*.py`` under ``tests/`` is collected by the README's test command.

pytest's default ``norecursedirs`` skips folders such as ``dist`` and ``build``, and a module that
fails to import is reported but easy to miss: either way a whole folder of tests can stop running
while the suite stays green (``tests/dist`` did, for two milestones). This runs the same collection
``make test`` does (the project's pytest config, every marker included) and compares it with the
files on disk.
"""
from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO


def test_every_test_file_is_collected():
    on_disk = set()
    for root, dirs, files in os.walk(os.path.join(REPO, "tests")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        on_disk |= {os.path.relpath(os.path.join(root, f), REPO) for f in files
                    if f.startswith("test_") and f.endswith(".py")}
    assert len(on_disk) > 50, on_disk  # the walk itself found the suite

    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", ""],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    collected = {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}
    missing = sorted(on_disk - collected)
    assert not missing, f"test files pytest does not collect (check norecursedirs, imports): {missing}"
