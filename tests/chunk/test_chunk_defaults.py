"""The chunk options left to the engine (``null``): communication form and warm-up share from the
budget, the world and the chunk size (engines/chunk/defaults.py), against the rule written out here
from bytes: a warm-up moment holds at most two communication units with their gradients."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from memopt.engines.chunk import defaults
from memopt.errors import ConfigError

MiB, GiB = 2**20, 2**30


def opts(ratio=None, msc=None):
    return SimpleNamespace(warmup_gpu_chunk_mem_ratio=ratio, mem_saving_comm=msc)


def test_group_all_gather_when_two_groups_fit_the_default_share():
    # 2 ranks, 1 MiB chunks, reuse: two groups = 2 x 2 x 1 MiB = 4 MiB <= 0.1 x 64 MiB
    assert defaults.comm_form(opts(), 2, 64 * MiB, MiB, 1) is False
    # 8 ranks of gpt_10b-sized fp16 chunks (0.94 GB): two groups are 15 GB, over 0.1 x 25.6 GiB
    assert defaults.comm_form(opts(), 8, int(25.6 * GiB), 939_778_048, 1) is True
    # a companion (accumulation) doubles the group: 2 x 2 x 2 x 1 MiB = 8 MiB > 6.4 MiB
    assert defaults.comm_form(opts(), 2, 64 * MiB, MiB, 2) is True
    assert defaults.comm_form(opts(msc=False), 8, int(25.6 * GiB), 939_778_048, 1) is False  # explicit wins
    assert defaults.comm_form(opts(), 1, MiB, MiB, 2) is False  # one rank: no communication


def test_warmup_share_holds_two_units():
    assert defaults.warmup_share(opts(), 100 * MiB, 1, MiB, 2) == 0.1  # 4 MiB of 100: the default is enough
    assert defaults.warmup_share(opts(), 10 * MiB, 1, MiB, 2) == 0.4  # 2 units x 1 MiB x 2 (gradient) of 10 MiB
    assert defaults.warmup_share(opts(), 30 * MiB, 2, MiB, 1) == 0.14  # 4 MiB of 30 MiB = 0.1333.. rounded up
    assert defaults.warmup_share(opts(), 3 * MiB, 1, MiB, 2) == 1.0  # more than the budget: at most all of it
    assert defaults.warmup_share(opts(ratio=0.05), 10 * MiB, 1, MiB, 2) == 0.05  # explicit wins


def test_budget_below_one_unit_is_refused_with_the_budget_that_holds_it():
    with pytest.raises(ConfigError) as e:
        defaults.warmup_share(opts(), MiB, 2, MiB, 1)  # a group of 2 chunks of 1 MiB in a 1 MiB budget
    msg = str(e.value)
    assert "strategy.chunk.device_budget_gb=0.0009766" in msg  # the value given
    assert "set it to at least 0.002," in msg and 0.002 * GiB >= 2 * MiB  # a budget that holds the unit
    assert "mem_saving_comm=true" in msg  # the other fix: units of one chunk


def test_warmup_share_above_one_is_refused_naming_null():
    from tests.conftest import typed

    with pytest.raises(ConfigError, match=r"warmup_gpu_chunk_mem_ratio=1.5 must be in \(0, 1\] or null"):
        typed(["+strategy=chunk", "strategy.chunk.warmup_gpu_chunk_mem_ratio=1.5"])
