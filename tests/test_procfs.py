"""Fields of this process's /proc/self/status."""

import sys

import pytest

from moestream.procfs import status_field


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_a_field_is_its_value_and_an_unknown_one_none():
    assert status_field("VmHWM").endswith(" kB") and int(status_field("VmHWM").split()[0]) > 0
    assert int(status_field("Umask"), 8) <= 0o777
    assert status_field("NoSuchField") is None
