"""Budgets parse without torch and print as a share of the experts."""

import subprocess
import sys

from moestream.budget import Budget


def test_a_budget_prints_as_a_percentage_of_the_expert_bytes():
    assert Budget.parse("0.25").percent(4096) == "25%"
    assert Budget.parse("1KiB").percent(4096) == "25%"
    assert Budget.parse("100%").percent(4096) == "100%"


def test_parsing_budgets_needs_no_torch():
    code = "import sys; from moestream.budget import Budget; Budget.parse('512MiB'); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False"


def test_a_bare_integer_is_refused_but_zero_and_sizes_are_read():
    import pytest

    from moestream.budget import parse_size
    from moestream.errors import BudgetError

    with pytest.raises(BudgetError, match="--expert-budget: '5' has no unit"):
        Budget.parse("5", "--expert-budget")
    assert Budget.parse("0").size_bytes == 0 and Budget.parse("5B").size_bytes == 5
    assert parse_size("1048576", "--chunk-size") == 1048576  # a size flag takes bytes
    with pytest.raises(BudgetError, match="--chunk-size takes a size"):
        parse_size("0.5", "--chunk-size")
