"""The benchmarks' order of engines (doors) in each round: balanced for position and for what ran
just before."""

import collections

import pytest

from benchmarks.common import round_order


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_a_cycle_puts_each_name_in_each_position_and_after_each_other_name_equally_often(n):
    names = [f"door{i}" for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    rounds = [round_order(names, turn) for turn in range(cycle)]
    assert all(sorted(order) == names for order in rounds)
    positions = collections.Counter((i, name) for order in rounds for i, name in enumerate(order))
    assert set(positions.values()) == {cycle // n}
    follows = collections.Counter(pair for order in rounds for pair in zip(order, order[1:]))
    if n > 1:
        assert len(follows) == n * (n - 1) and set(follows.values()) == {cycle // n}
    assert [round_order(names, turn) for turn in range(cycle, 2 * cycle)] == rounds  # and then again


def test_three_doors_are_not_only_rotated():
    """A rotation keeps the cycle's order (a, b, c): c would always run right before a."""
    orders = [round_order(["a", "b", "c"], turn) for turn in range(6)]
    assert ["c", "b", "a"] in orders and ["a", "b", "c"] in orders
