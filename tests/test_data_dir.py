"""The data directory is found the same way from any working directory, and says how it was found."""

from pathlib import Path

import moestream
from moestream.bench.tools.data_dir import resolve_data_dir

BESIDE_CHECKOUT = Path(moestream.__file__).resolve().parents[1].parent / "shared" / "data"


def test_an_explicit_directory_wins_and_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESTREAM_DATA", str(tmp_path / "env"))
    data = resolve_data_dir(tmp_path)
    assert data.path == tmp_path and "--data-dir" in data.describe()


def test_the_environment_comes_before_any_guess(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESTREAM_DATA", str(tmp_path / "env"))
    data = resolve_data_dir()
    assert data.path == tmp_path / "env" and "$MOESTREAM_DATA, absent" in data.describe()


def test_the_working_directory_does_not_change_what_is_found(tmp_path, monkeypatch):
    monkeypatch.delenv("MOESTREAM_DATA", raising=False)
    first = resolve_data_dir()
    monkeypatch.chdir(tmp_path)
    second = resolve_data_dir()
    if BESIDE_CHECKOUT.is_dir():
        assert first == second and second.path == BESIDE_CHECKOUT
    else:  # an installed package: the guess is ../shared/data from the working directory, and says so
        assert second.path == tmp_path.parent / "shared" / "data" and "working directory" in second.source
