"""write_json_atomic: the whole new file or the old one, and no temporary file left behind."""
from __future__ import annotations

import json

import pytest

from hybridrec.core.layouts.files import write_json_atomic


@pytest.mark.parametrize("fsync", [False, True])
def test_write_replace_and_no_leftovers(tmp_path, fsync):
    path = tmp_path / "services.json"
    write_json_atomic(path, [{"name": "ps", "replica": 0}], fsync=fsync)
    write_json_atomic(path, {"step": 3}, fsync=fsync)
    assert json.loads(path.read_text()) == {"step": 3}
    assert path.read_text() == json.dumps({"step": 3}, indent=2)
    assert [p.name for p in tmp_path.iterdir()] == ["services.json"]


def test_missing_directory_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_json_atomic(tmp_path / "nope" / "manifest.json", {})
