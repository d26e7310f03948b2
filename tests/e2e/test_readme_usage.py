"""The README's usage block, checked as typed: every single-run command there composes, passes the config rules
and the preflight on this machine. Why: the block's chunk-engine line ("budget below the model") had been
refused by the preflight since it was added for a smaller micro-batch, and nothing read the README."""
from __future__ import annotations

import os
import re
import shlex

import pytest

from tests.conftest import REPO, typed


def usage_commands() -> list[list[str]]:
    """The ``python -m memopt.train`` lines of the README's first bash block after "## Usage", comments dropped:
    single runs only (a sweep's jobs are single runs of the same form)."""
    text = open(os.path.join(REPO, "README.md")).read()
    block = re.search(r"## Usage\s+```bash\n(.*?)```", text, re.S).group(1)
    out = []
    for line in block.splitlines():
        words = shlex.split(line.split("#", 1)[0])
        if words[:3] == ["python", "-m", "memopt.train"] and "-m" not in words[3:]:
            out.append(words[3:])
    return out


def test_the_usage_block_holds_the_commands_it_shows():
    cmds = usage_commands()
    assert len(cmds) >= 10 and [] in cmds and any("+strategy=chunk" in c for c in cmds)


@pytest.mark.parametrize("args", usage_commands(), ids=lambda a: " ".join(a)[:60] or "default")
def test_a_usage_command_passes_the_preflight_here(tmp_path, args):
    """What a run of the command checks before its ranks start (the gate's config rules, then its preflight,
    which plans the run where it comes near its memory): refused, the command would end before training."""
    from memopt.gate import hardware
    from memopt.planner.preflight import PreflightRefusal, preflight

    corpus = tmp_path / "corpus.txt"  # the block's text_file line names corpus.txt in the working directory
    corpus.write_text("Any local UTF-8 text will do. " * 400)
    cfg = typed([f"data.path={corpus}" if a == "data.path=corpus.txt" else a for a in args])
    try:
        preflight(cfg, hardware(cfg))
    except PreflightRefusal as e:
        pytest.fail(f"{' '.join(args)}: {e}")
