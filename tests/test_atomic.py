import json

import pytest

from moestream.atomic import atomic_path, write_json
from moestream.errors import MoestreamError


def test_write_json_creates_parents_and_leaves_no_temp_file(tmp_path):
    path = write_json({"a": 1}, tmp_path / "x" / "y.json")
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in path.parent.iterdir()] == ["y.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temp(tmp_path):
    path = write_json({"old": True}, tmp_path / "r.json")
    with pytest.raises(ValueError):
        with atomic_path(path) as tmp:
            tmp.write_text("half")
            raise ValueError("interrupted")
    assert json.loads(path.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_writing_below_a_file_is_a_user_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(MoestreamError, match="cannot write"):
        write_json({}, blocker / "out.json")
