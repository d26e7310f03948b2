"""The README's "add a strategy" steps, followed literally in a copy of the package: one module in
memopt/strategies/ and one yaml in conf/strategy/, nothing else edited. The new strategy (the MLP of
every block recomputed in the backward) must be selectable, validated, applied, refused by an engine
that does not implement it, and must leave the loss trajectory of the plain run unchanged."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

from tests.conftest import REPO

MODULE = textwrap.dedent('''
    """``+strategy=mlp_ckpt``: recompute every block's MLP in the backward (a test strategy)."""
    from dataclasses import dataclass

    import torch
    from torch.utils.checkpoint import checkpoint

    from memopt.errors import ConfigError
    from memopt.strategies.base import Build, Strategy, register


    @dataclass
    class MlpCkptConfig:
        every: int = 1  # every k-th block


    def recompute(module):
        """Checkpoint the module's own forward in place: its parameter names (and so its init) are kept."""
        plain = module.forward
        module.forward = lambda x: checkpoint(plain, x, use_reentrant=False)
        return module


    @register
    class MlpCkpt(Strategy):
        name, Config, phase, order = "mlp_ckpt", MlpCkptConfig, "model", 25

        def validate(self, opts, cfg):
            if opts.every < 1:
                raise ConfigError(f"strategy.mlp_ckpt.every={opts.every} must be >= 1")

        def apply(self, model, opts, build: Build):
            for i in range(0, len(model.blocks), opts.every):
                model.set_slot(i, "mlp", recompute(model.slot(i, "mlp")))
''')
YAML = "# Recompute the MLP of every k-th block.\nmlp_ckpt:\n  every: 1\n"

SCRIPT = textwrap.dedent('''
    import json, sys
    from memopt.api import run_job
    from memopt.config import to_dataclass, validate
    from memopt.api import compose_config
    base = ["model=gpt_tiny", "model.seq_len=32", "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0",
            "trainer.micro_batch_size=2", "logger=none", "trainer.progress_bar=false", "trainer.save_checkpoint=false"]
    out = {}
    for name, extra in (("plain", []), ("new", ["+strategy=mlp_ckpt"])):
        s = run_job(base + extra, sys.argv[1] + "/" + name)
        out[name] = {"strategy": s["strategy"], "acts": s["peak_bytes"]["0"]["cpu"]["activations"],
                     "losses": [json.loads(l)["loss"] for l in open(sys.argv[1] + "/" + name + "/metrics.jsonl")]}
    for key, extra in (("bad", ["+strategy=mlp_ckpt", "strategy.mlp_ckpt.every=0"]),
                       ("fsdp2", ["+strategy=[zero3,mlp_ckpt]", "engine=fsdp2"])):
        try:
            validate(to_dataclass(compose_config(extra)))
            out[key] = None
        except Exception as e:
            out[key] = str(e)
    print("RESULT" + json.dumps(out))
''')


def test_one_module_and_one_yaml_add_a_strategy(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(REPO, "memopt"), repo / "memopt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(REPO, "conf"), repo / "conf")
    (repo / "memopt" / "strategies" / "mlp_ckpt.py").write_text(MODULE)
    (repo / "conf" / "strategy" / "mlp_ckpt.yaml").write_text(YAML)
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "runs")], cwd=str(repo), capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(repo)), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.split("RESULT", 1)[1])
    assert out["new"]["strategy"] == ["mlp_ckpt"]
    assert out["new"]["losses"] == out["plain"]["losses"]  # recomputation changes memory, never the math
    assert out["new"]["acts"] < out["plain"]["acts"]  # the MLP's hidden activations are no longer kept
    assert "strategy.mlp_ckpt.every=0" in out["bad"]
    assert "strategy mlp_ckpt has no FSDP2 equivalent" in out["fsdp2"]
