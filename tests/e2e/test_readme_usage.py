"""The README's usage block, planned as typed (``trainer.mode=plan``, in this process): every single-run command
there composes and fits this machine. Why: the block's chunk-engine line ("budget below the model") had been
refused by the preflight since it was added for a smaller micro-batch, and nothing read the README."""
from __future__ import annotations

import json
import os
import re
import shlex

import pytest

from tests.conftest import REPO, cli_main


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
def test_a_usage_command_plans_and_fits_here(tmp_path, args, capsys, monkeypatch):
    # the fit is the question, not the step time: this CPU's step-time probes (10-20 s a process) are skipped
    monkeypatch.setattr("memopt.planner.cpu_rates.complete", lambda spec, hw, device, model: hw)
    corpus = tmp_path / "corpus.txt"  # the block's text_file line names corpus.txt in the working directory
    corpus.write_text("Any local UTF-8 text will do. " * 400)
    args = [f"data.path={corpus}" if a == "data.path=corpus.txt" else a for a in args]
    d = tmp_path / "plan"
    rc = cli_main([*args, "logger=none", "trainer.mode=plan", f"hydra.run.dir={d}"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    plan = json.loads((d / "plan.json").read_text())
    assert plan["fits"], (plan.get("error"), plan.get("suggestion"))
