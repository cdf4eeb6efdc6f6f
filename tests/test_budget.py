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
