"""argparse's own refusals (a wrong type, a missing value) are one line naming the flag."""

import pytest

from moestream.cli import main


@pytest.mark.parametrize("argv, named", [
    (["generate", "--model", "x", "--max-new-tokens", "abc"], "argument --max-new-tokens: invalid int value"),
    (["bench", "engine", "--budgets"], "argument --budgets: expected one argument"),
    (["sim"], "the following arguments are required: --trace"),
    (["nope"], "invalid choice: 'nope'"),
])
def test_a_parse_error_is_one_line_naming_the_flag(capsys, argv, named):
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and named in err and len(err.strip().splitlines()) == 1
