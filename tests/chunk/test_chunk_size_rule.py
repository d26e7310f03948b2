"""The chunk size the engine chooses when ``strategy.chunk.chunk_size`` is null (engines/chunk/defaults.py),
against the rule written out here from bytes, not from the engine's search:

    the aligned size c in [m, 4m] (m: the largest tensor rounded up to 1024 elements; at most the largest
    size whose two units of one chunk with gradients fit the device budget) that minimises the bytes the
    busiest of W ranks holds because of c:

        ceil(trainable chunks / W) * c * (payload * g + 12) + ceil(frozen chunks / W) * c * payload + (2 * payload + 6) * c

    (trainable / frozen chunks: the greedy in-order packing, a tensor never split, re-derived here; 12:
    fp32 master, momentum, variance; 2 * payload: the host step's two staging chunks, 6: half an optimizer group);
    ties to the smaller size.

Every aligned size is tried here (brute force); the engine bisects per chunk count. An explicit value
still wins; one below the largest parameter, or one whose unit the budget cannot hold, is refused before
anything is allocated, naming the value that would work."""
from __future__ import annotations

import math
import random

import pytest

from memopt.engines.chunk import defaults
from memopt.errors import ConfigError

ALIGN = 1024


def n_chunks(sizes: list[int], c: int) -> int:
    n, room = 0, 0
    for k in sizes:
        if k > room:
            n, room = n + 1, c
        room -= k
    return n


def busiest_rank_bytes(groups: list[list[int]], c: int, world: int, payload: int, g: int) -> int:
    dense, expert, frozen = (n_chunks(x, c) if x else 0 for x in groups)
    return (math.ceil((dense + expert) / world) * c * (payload * g + 12) + math.ceil(frozen / world) * c * payload
            + (2 * payload + 6) * c)


def brute_force(groups: list[list[int]], world: int, payload: int, g: int, budget: int | None) -> int:
    m = math.ceil(max(k for x in groups for k in x) / ALIGN) * ALIGN
    top = 4 * m if budget is None else max(m, min(4 * m, budget // (2 * payload * g) // ALIGN * ALIGN))
    return min(range(m, top + 1, ALIGN), key=lambda c: (busiest_rank_bytes(groups, c, world, payload, g), c))


def named(groups: list[list[int]]) -> list[list[tuple[str, int]]]:
    return [[(f"g{i}.t{j}", k) for j, k in enumerate(x)] for i, x in enumerate(groups)]


@pytest.mark.parametrize("seed", range(6))
def test_the_choice_minimises_the_busiest_ranks_bytes(seed):
    rng = random.Random(seed)
    dense = [rng.choice([3, 5, 8, 13, 21, 34]) * 1000 + rng.randrange(1000) for _ in range(rng.randrange(8, 40))]
    expert = [rng.randrange(2000, 30000) for _ in range(rng.randrange(0, 6))]
    frozen = [rng.randrange(500, 20000) for _ in range(rng.randrange(0, 4))]
    groups = [dense, expert, frozen]
    for world in (1, 2, 8):
        for payload, g in ((2, 1), (2, 2), (4, 1)):
            for budget in (None, 400_000, 10**6):
                got = defaults.chunk_size(None, named(groups), world, payload, g, budget)
                assert got == brute_force(groups, world, payload, g, budget), (seed, world, payload, g, budget)


def test_gpt_10b_on_patrickstars_node_gets_chunks_of_the_embedding():
    """139 blocks of width 4096 on 8 V100s (budget 0.8 x 32 GiB): the embedding's 50304 x 4096 elements
    (groups of 2.3 GiB), where the least padding (3 blocks a chunk, 0.68% against 2.28%) makes groups
    of 6.75 GiB and costs the busiest rank more bytes by the rule."""
    d, vocab, seq = 4096, 50304, 1024
    block = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]  # ln, qkv, proj, ln, fc, fc2
    assert sum(block) == 12 * d * d + 13 * d
    sizes = [vocab * d, seq * d, *block * 139, d, d]
    budget = int(0.8 * 32 * 2**30)
    got = defaults.chunk_size(None, [[("t", k) for k in sizes], [], []], 8, 2, 1, budget)
    assert got == vocab * d == 206_045_184
    least_padding = min((c for c in (got, 412_090_368, 604_139_520)), key=lambda c: n_chunks(sizes, c) * c)
    assert least_padding == 604_139_520  # 3 blocks a chunk
    assert busiest_rank_bytes([sizes, [], []], got, 8, 2, 1) < busiest_rank_bytes([sizes, [], []], least_padding, 8, 2, 1)
    assert 12 * got / 2**30 < 2.31 and 12 * least_padding / 2**30 > 6.7


def test_an_explicit_chunk_size_wins_and_a_bad_one_names_what_works():
    groups = [[("a", 5000), ("b", 7000), ("c", 3000)], [], []]
    assert defaults.chunk_size(9000, groups, 1, 2, 1, None) == 9000
    with pytest.raises(ConfigError) as e:
        defaults.chunk_size(6000, groups, 1, 2, 1, None)
    msg = str(e.value)
    assert "parameter b has 7000 elements, more than strategy.chunk.chunk_size=6000" in msg
    assert "set it to at least 7000 (the largest parameter, b; a multiple of 1024: 7168)" in msg
    assert f"the engine's choice here: {brute_force([[5000, 7000, 3000], [], []], 1, 2, 1, None)}" in msg


def test_the_cli_refuses_before_allocation(tmp_path):
    from tests.conftest import train

    base = ["model=gpt_tiny", "model.seq_len=32", "trainer.max_steps=1", "+strategy=chunk"]
    with pytest.raises(ConfigError, match=r"more than strategy.chunk.chunk_size=1000: .* set it to at least 65536 "):
        train([*base, "strategy.chunk.chunk_size=1000"], str(tmp_path / "small"))
    # one unit of 262144 fp32 elements (1 MiB) in a 0.5 MiB budget: a chunk size whose unit fits is named
    with pytest.raises(ConfigError, match=r"cannot hold one communication unit .* set strategy.chunk.chunk_size at most 131072 "):
        train([*base, "strategy.chunk.chunk_size=262144", "strategy.chunk.device_budget_gb=0.00048828125"],
              str(tmp_path / "unit"))
    # a budget below the largest parameter's unit (65536 fp32 elements, 256 KiB): no chunk size helps
    with pytest.raises(ConfigError, match=r"cannot hold one communication unit .*no chunk size helps \(a chunk holds at least "
                                          r"the largest parameter, 65536 elements"):
        train([*base, "strategy.chunk.device_budget_gb=0.0001"], str(tmp_path / "none"))
