"""Tables printed to a file or pipe keep whole cells."""

from moestream.report import report_console


def test_a_console_on_a_pipe_is_as_wide_as_asked(capsys):
    from rich.table import Table

    table = Table()
    for column in ("policy", "a long column heading", "another long column heading", "a third heading"):
        table.add_column(column, no_wrap=True)
    table.add_row("moe-infinity-norefine", "1", "2", "3")
    report_console(140).print(table)
    out = capsys.readouterr().out
    assert "moe-infinity-norefine" in out and "another long column heading" in out and "…" not in out
