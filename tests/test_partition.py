"""Shard plans: uniform, parameter-balanced (exact), and checks of explicit plans."""

import itertools
import random

import pytest
from torch import nn

from raypipe import ConfigError, LayerSpec
from raypipe.layers import parameter_counts
from raypipe.partition import balanced_plan, check_plan, make_plan, uniform_plan


def test_uniform_spreads_the_remainder_over_the_last_stages():
    assert uniform_plan(7, 3) == [(0, 2), (2, 4), (4, 7)]
    assert uniform_plan(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert uniform_plan(5, 5) == [(i, i + 1) for i in range(5)]


def _brute_force(weights, p):
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        cost = max(sum(weights[bounds[i]:bounds[i + 1]]) for i in range(p))
        best = cost if best is None else min(best, cost)
    return best


def test_balanced_plan_is_optimal():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        p = rng.randint(1, n)
        weights = [rng.randint(0, 20) for _ in range(n)]
        plan = balanced_plan(weights, p)
        check_plan(plan, n, p)
        cost = max(sum(weights[a:b]) for a, b in plan)
        assert cost == _brute_force(weights, p), (weights, p, plan)


def test_parameter_partition_counts_without_allocating():
    specs = [LayerSpec(nn.Linear, 1000, 1000), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 1000, 10),
             LayerSpec(nn.Linear, 10, 10)]
    counts = parameter_counts(specs)
    assert counts == [1_001_000, 0, 10_010, 110]
    assert make_plan(4, 2, "parameters", parameter_counts=counts) == [(0, 1), (1, 4)]


@pytest.mark.parametrize(
    "plan, problem",
    [
        ([[0, 2], [3, 5]], "gap before stage 1"),
        ([[0, 3], [2, 5]], "overlapping"),
        ([[0, 2], [2, 6]], "past the last layer"),
        ([[0, 0], [0, 5]], "empty"),
        ([[0, 2], [2, 4]], "layers 4..4 belong to no stage"),
        ([[0, 5]], "1 ranges for pp=2"),
    ],
)
def test_bad_plans_name_the_problem_and_the_fix(plan, problem):
    with pytest.raises(ConfigError) as info:
        check_plan(plan, 5, 2)
    message = str(info.value)
    assert "shard_plan" in message and problem in message
    assert "[[0, 2], [2, 5]]" in message  # a plan that would work


def test_more_stages_than_layers_is_a_config_error():
    with pytest.raises(ConfigError, match="only 2 layers"):
        make_plan(2, 3)
