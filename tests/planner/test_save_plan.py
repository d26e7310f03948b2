"""The final model.pt save and resumable checkpoints, planned and measured: the weights of model.pt are
streamed (``Engine.iter_full_state``, ``memopt.model_file``), so that save holds one gathered unit's
fp32 copy, not the whole model; a checkpoint's state dict (``checkpoint.parts``: the weights' copies,
a temporary) is planned too. The planner runs the same code on fake tensors and predicts both peaks.

References: the tracker's measured peak of the run (``tests/planner/test_accuracy.py``'s comparison)
and the model's whole fp32 weights (4 B x parameters), which the old save held on every rank.
"""
from __future__ import annotations

import pytest

from tests.planner.test_accuracy import compare, measured, planned

SAVE = ["trainer.save_checkpoint=true", "trainer.checkpoint_every=1", "model.n_layer=4"]


def _whole_fp32(overrides: list[str], world: int) -> int:
    from memopt import compose
    from tests.conftest import typed

    return 4 * compose.num_params(typed([*overrides, f"trainer.nproc_per_node={world}"]))


def _check(overrides: list[str], world: int, tmp_path, streamed: bool = True) -> None:
    ov = [*overrides, *SAVE]
    plan = planned(ov, world)
    slack: dict = {}
    real = measured(ov, world, tmp_path, slack)
    bad = compare(plan, real, slack)
    assert not bad, f"{ov} on {world} rank(s):\n" + "\n".join(bad)
    # the save's own bytes: the measured peak over the planned one without the save (which the
    # accuracy matrix holds to the measured run without it); the old save held the whole fp32 model
    before = planned([*overrides, *SAVE, "trainer.save_checkpoint=false"], world)
    whole = _whole_fp32(ov, world)
    for rank, devs in real.items():
        added = devs["device"]["other"] - before[rank]["device"]["other"]
        assert 0 <= added < (whole / 2 if streamed else 3 * whole), (rank, added, whole)  # 0: fp32 weights on the host are written as they are
    assert (tmp_path / "run" / "model.pt").is_file()


def test_final_save_chunk_engine_one_process(tmp_path):
    _check(["+strategy=chunk"], 1, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [["+strategy=chunk"], ["+strategy=hybrid_adam_fp32"], ["+strategy=zero3"],
                                       ["engine=fsdp2", "+strategy=zero3"],
                                       ["model=moe_tiny", "+strategy=zero2", "parallel.ep=2"]],
                         ids=["chunk", "hybrid_adam_fp32", "zero3", "fsdp2_zero3", "moe_ep2_zero2"])
def test_final_save_two_ranks(overrides, tmp_path):
    # moe_ep2_zero2: the experts are gathered over ep by all_gather_object (pickled, gathered, unpickled:
    # engines.base._fake_ep_parts plans it; fake tensors do not pickle, so plan mode had crashed). With
    # expert parallelism the save is the whole dict, not streamed (docs/design.md): measured 1.96x the
    # fp32 model on top of the run (the dict and the gather's pickled copies), planned within 3%
    _check(overrides, 2, tmp_path, streamed="parallel.ep=2" not in overrides)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_saves_deepspeed_two_ranks(stage, tmp_path):
    """DeepSpeed with model.pt and a resumable checkpoint every step, compared as the DeepSpeed matrix is
    (``params``, ``optim``, ``activations``, the device total: its buffers' grads/temp split and its
    init-time ``other`` are timing, see test_accuracy_deepspeed.py). Its saves are not its peak: the
    measured totals with and without them were equal (gpt_tiny, 4 blocks, 2 ranks), so this holds the
    plan, which streams model.pt as memopt's engine does, to the run with them."""
    from tests.planner.test_accuracy_deepspeed import compare_deepspeed

    ov = ["engine=deepspeed", f"+strategy={stage}", *SAVE]
    bad = compare_deepspeed(planned(ov, 2), measured(ov, 2, tmp_path))
    assert not bad, "\n".join(bad)
    assert (tmp_path / "run" / "model.pt").is_file() and any((tmp_path / "run" / "checkpoints").iterdir())
