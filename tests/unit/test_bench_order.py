"""The benchmarks' order statistics (``experiments/common.py``): Spearman's rank correlation against Pearson's
correlation of the ranks (its definition, computed by ``statistics``), and the misordered pairs' gaps against
the pairs written out by hand."""
from __future__ import annotations

import random
import statistics

import pytest

from experiments.common import spearman, widest_misordered_pair


def _ranks(x):
    return [sorted(x).index(v) for v in x]


@pytest.mark.parametrize("seed", range(5))
def test_spearman_is_the_correlation_of_the_ranks(seed):
    rng = random.Random(seed)
    a = [rng.random() for _ in range(7)]
    b = [v + rng.gauss(0, 0.3) for v in a]
    assert spearman(a, b) == pytest.approx(statistics.correlation(_ranks(a), _ranks(b)))


def test_misordered_names_the_widest_planned_gap_among_pairs_measured_the_other_way():
    # (0, 1) agrees with the measurement; (1, 2) is planned 2.9% apart and (0, 2) 5.0%, measured 1.0% the other way
    assert widest_misordered_pair([10.0, 10.2, 10.5], [10.1, 10.3, 10.0]) == \
        "; misordered pairs planned at most 5.0% apart (that pair measured 1.0% apart)"
    assert widest_misordered_pair([10.0, 10.01, 12.0], [10.1, 10.0, 13.0]).startswith("; misordered pairs planned at most 0.1% apart")
    assert widest_misordered_pair([1.0, 2.0, 3.0], [1.5, 2.5, 2.6]) == ""
