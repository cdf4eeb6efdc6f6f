"""`moestream top --url` that is no server address: one line naming --url and what it expects, exit 2
(no server is needed to refuse it)."""

import pytest

from moestream.cli import main


@pytest.mark.parametrize("url", ["notaurl", "127.0.0.1:8000", "ftp://127.0.0.1:8000", "http://", "http://[::1",
                                 "http://127.0.0.1:port"])
def test_a_url_that_is_no_server_address_is_one_line_naming_the_flag(url, capsys):
    assert main(["top", "--url", url, "--once"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and error.startswith("moestream: error: --url")
    assert "http://127.0.0.1:8000" in error and repr(url) in error and "None" not in error
