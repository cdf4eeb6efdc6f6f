"""Budgets parse without torch and print as a share of the experts."""

import subprocess
import sys

import pytest

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



def test_a_ratio_over_one_is_refused_naming_the_flag():
    from moestream.errors import BudgetError

    for text in ("200%", "1.5"):
        with pytest.raises(BudgetError, match=f"^--expert-budget: '{text}' is more than all the experts"):
            Budget.parse(text, "--expert-budget")
    assert Budget.parse("100%").ratio == 1.0 and Budget.parse("1.0").ratio == 1.0


def test_a_size_only_budget_suggests_sizes_only():
    from moestream.errors import BudgetError

    for text, message in (("abc", "cannot read 'abc': use a size like 512MiB$"), ("5", "'5' has no unit: write a size"),
                          ("25%", "takes a size like 512MiB, not a ratio")):
        with pytest.raises(BudgetError, match=f"^--kv-budget: {message}") as refused:
            Budget.parse(text, "--kv-budget", ratios=False)
        assert "ratio like" not in str(refused.value) and "write a ratio" not in str(refused.value)
    assert Budget.parse("512MiB", "--kv-budget", ratios=False).size_bytes == 512 << 20


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "hi", "--expert-budget", "200%"], "--expert-budget: '200%' is more than all the experts"),
    (["generate", "--prompt", "hi", "--host-budget", "1.5"], "--host-budget: '1.5' is more than all the experts"),
    (["serve", "--kv-budget", "abc"], "--kv-budget: cannot read 'abc': use a size like 512MiB"),
    (["bench", "engine", "--streaming", "--small", "--budgets", "0.25,200%"], "--budgets: '200%' is more than all the experts"),
    (["bench", "engine", "--small", "--budgets", "abc"], "--budgets: cannot read 'abc'"),
])
def test_every_refused_budget_flag_is_one_line_naming_it(tiny_checkpoint, capsys, argv, message):
    from moestream.cli import main

    model = [] if argv[0] == "bench" else ["--model", str(tiny_checkpoint("mixtral", num_layers=2))]
    assert main([*argv, *model]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"moestream: error: {message}")
