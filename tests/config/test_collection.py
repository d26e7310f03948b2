"""Every ``test_*.py`` under ``tests/`` is collected by the README's test command.

pytest's default ``norecursedirs`` skips folders such as ``dist`` and ``build``, and a module that
fails to import is reported but easy to miss: either way a whole folder of tests can stop running
while the suite stays green (``tests/dist`` did, for two milestones). When this session collected the
whole suite (``make test``), the files it collected (before ``-m`` deselection, ``tests/conftest.py``)
are compared with the files on disk; run on its own, it runs that collection in a subprocess.
"""
from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import COLLECTED, REPO, SESSION_ARGS


def collected_by_the_test_command() -> set[str]:
    tests = os.path.join(REPO, "tests")
    if SESSION_ARGS and all(a in (REPO, tests) for a in SESSION_ARGS):  # this session is the whole suite
        return set(COLLECTED)
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", ""],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}


def test_every_test_file_is_collected():
    on_disk = set()
    for root, dirs, files in os.walk(os.path.join(REPO, "tests")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        on_disk |= {os.path.relpath(os.path.join(root, f), REPO) for f in files
                    if f.startswith("test_") and f.endswith(".py")}
    assert len(on_disk) > 50, on_disk  # the walk itself found the suite
    missing = sorted(on_disk - collected_by_the_test_command())
    assert not missing, f"test files pytest does not collect (check norecursedirs, imports): {missing}"
