"""``+strategy=moe`` on the chunk engine (PatrickStar's chunks; expert parameters in chunks of their own,
in registration order; ep=1). The reference is the plain fp32 memopt run of the same job: the chunk engine
changes where bytes live, not the math, so the trajectories agree to float rounding (observed <= 1e-7;
tolerance 1e-6). The router is a module call, so the chunk hooks fetch its chunk before the gate runs,
also under a device budget smaller than the model (evictions)."""
from __future__ import annotations

import pytest

from memopt.api import run_jobs_on_ranks
from memopt.errors import ConfigError
from tests.conftest import losses, train, typed

BASE = ["model=moe_tiny", "model.seq_len=32", "model.n_layer=2", "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0",
        "trainer.micro_batch_size=2", "optim.lr=3e-3", "optim.warmup_steps=0"]
TOL = 1e-6


def rel_err(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_chunk_engine_with_moe_follows_plain_under_a_small_budget(tmp_path, monkeypatch):
    from memopt.models.moe import Expert
    from tests.chunk.helpers import train_capture

    plain = train(BASE, str(tmp_path / "plain"))
    budget = 6 * 2**20  # below the param + grad chunks: 0.83M params x 4 B x 2 = 6.3 MiB
    s, engine = train_capture([*BASE, "+strategy=chunk", f"strategy.chunk.device_budget_gb={budget / 2**30}",
                               "strategy.chunk.warmup_gpu_chunk_mem_ratio=0.4"], str(tmp_path / "chunk"), monkeypatch)
    # expert parameters have chunks of their own: no chunk mixes them with dense parameters
    experts = {f"{mn}.{pn}" for mn, m in engine.model.named_modules() if isinstance(m, Expert) for pn, _ in m.named_parameters()}
    kinds = [{t.name in experts for t in c.tensors} for c in engine.mgr.chunks if c.tensors]
    assert all(len(k) == 1 for k in kinds) and {True} in kinds and {False} in kinds
    assert plain["status"] == s["status"] == "ok" and s["engine"] == "memopt"
    assert s["params"] == plain["params"] and s["active_params"] == plain["active_params"]
    got, ref = losses(str(tmp_path / "chunk")), losses(str(tmp_path / "plain"))
    assert len(got) == 3 and rel_err(got, ref) <= TOL, (got, ref)
    assert s["params"] * 8 > budget >= s["peak_bytes"]["0"]["cpu"]["chunks"]  # the budget holds


@pytest.mark.slow
def test_chunk_engine_with_moe_on_two_ranks_and_accumulation(tmp_path):
    jobs = [([*BASE, "+strategy=ddp", "logger=none", "trainer.progress_bar=false", "trainer.save_checkpoint=false"], str(tmp_path / "ddp")),
            ([*BASE, "+strategy=chunk", "logger=none", "trainer.progress_bar=false", "trainer.save_checkpoint=false"], str(tmp_path / "chunk"))]
    run_jobs_on_ranks(2, jobs)
    assert rel_err(losses(str(tmp_path / "chunk")), losses(str(tmp_path / "ddp"))) <= TOL
    accum = ["trainer.grad_accum=2", "trainer.micro_batch_size=1"]
    train([*BASE, *accum], str(tmp_path / "plain_accum"))
    train([*BASE, *accum, "+strategy=[chunk,ckpt]"], str(tmp_path / "chunk_accum"))
    assert rel_err(losses(str(tmp_path / "chunk_accum")), losses(str(tmp_path / "plain_accum"))) <= TOL


def test_chunk_engine_refuses_expert_parallelism():
    with pytest.raises(ConfigError) as e:
        typed(["model=moe_tiny", "+strategy=chunk", "parallel.ep=2", "trainer.nproc_per_node=2"])
    assert "parallel.ep=2" in str(e.value)
