"""The planner with flash_attn (kernels under Triton's interpreter here): planned peaks within 3% of
measured, every category. The interpreter's launches used to hold their arguments until Python's cyclic
collector ran (``kernels/flash_attn._launches``), which no plan of a compiled launch has: 66,560 B more
``temp`` measured on one rank (the last backward's ``do``, ``dq`` and ``delta``)."""
import pytest

from tests.planner.test_accuracy import check


@pytest.mark.slow
def test_plan_matches_measured_flash_attn(tmp_path):
    check(["+strategy=flash_attn", "model.d_model=64", "model.n_head=2"], 1, tmp_path)


@pytest.mark.slow
def test_plan_matches_measured_flash_attn_two_ranks(tmp_path):
    check(["+strategy=[flash_attn,zero2]", "model.d_model=64", "model.n_head=2"], 2, tmp_path)


@pytest.mark.slow
def test_plan_matches_measured_flash_attn_ckpt_wider(tmp_path):
    check(["+strategy=[flash_attn,ckpt]", "model.n_layer=3", "model.d_model=128", "model.n_head=4"], 1, tmp_path)
