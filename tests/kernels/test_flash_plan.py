"""The planner with flash_attn (kernels under Triton's interpreter here): planned peaks within 3% of measured."""
import pytest

from tests.planner.test_accuracy import check


@pytest.mark.slow
def test_plan_matches_measured_flash_attn(tmp_path):
    # temp (and so total) excluded: Triton's interpreter copies the kernels' arguments on every launch,
    # temporaries a compiled kernel does not have; the plan has the GPU's (none)
    check(["+strategy=flash_attn", "model.d_model=64", "model.n_head=2"], 1, tmp_path, skip=("temp", "total"))


@pytest.mark.slow
def test_plan_matches_measured_flash_attn_two_ranks(tmp_path):
    check(["+strategy=[flash_attn,zero2]", "model.d_model=64", "model.n_head=2"], 2, tmp_path, skip=("temp", "total"))
