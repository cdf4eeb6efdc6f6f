"""Fields of this process's /proc/self/status."""

import sys

import pytest

from moestream.procfs import status_field, status_mib


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_a_field_is_its_value_and_an_unknown_one_none():
    assert status_field("VmHWM").endswith(" kB") and int(status_field("VmHWM").split()[0]) > 0
    assert int(status_field("Umask"), 8) <= 0o777
    assert status_field("NoSuchField") is None


def test_size_fields_read_in_mib(monkeypatch):
    monkeypatch.setattr("moestream.procfs.status_field", {"VmRSS": "861232 kB"}.get)
    assert status_mib("VmRSS") == 861232 / 1024
    assert status_mib("NoSuchField") is None
