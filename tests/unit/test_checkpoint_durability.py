"""A job checkpoint survives a power loss (hybridrec/core/layouts/checkpoints.py): rank 0's files are fsynced with their
directory before the manifest, the root after the rename, and the manifest records each file's size and
sha256; `latest` verifies them and falls back to the newest checkpoint that verifies, naming the one it
skipped and why (on 3b8ae06 a cut-short dense.pt was resumed from, and failed as "another model")."""
from __future__ import annotations

import json
import os

import pytest
from structlog.testing import capture_logs

from hybridrec.core.layouts import checkpoints


def _checkpoint(root, step: int, *, dense: bytes = b"dense-state" * 100, recorded: bool = True):
    """A complete checkpoint of rank 0's files, sealed and published as the NN worker writes one."""
    final = checkpoints.step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    tmp.mkdir(parents=True)
    (tmp / checkpoints.DENSE).write_bytes(dense)
    (tmp / checkpoints.CONFIG).write_text(f"step: {step}\n")
    checkpoints.seal(tmp)
    files = {name: checkpoints.file_entry(tmp / name) for name in (checkpoints.DENSE, checkpoints.CONFIG)}
    checkpoints.write_manifest(tmp, checkpoints.JobManifest(step=step, seq=step, position=[0, 0, 0, 0],
                                                            files=files if recorded else {}))
    checkpoints.publish(tmp, final)
    return final


def test_the_manifest_records_every_file_and_a_whole_checkpoint_verifies(tmp_path):
    path = _checkpoint(tmp_path, 4)
    manifest = checkpoints.read_manifest(path)
    assert set(manifest.files) == {checkpoints.DENSE, checkpoints.CONFIG}
    assert manifest.files[checkpoints.DENSE]["bytes"] == 1100 and len(manifest.files[checkpoints.DENSE]["sha256"]) == 64
    assert checkpoints.verify_files(path, manifest) is None
    assert checkpoints.latest(tmp_path)[0] == path and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("damage, why", [
    ("truncate", "dense.pt is 500 bytes, the manifest says 1100 (cut short)"),
    ("flip", "dense.pt's sha256 differs from the manifest's"),
    ("remove", "dense.pt is missing"),
    ("manifest", "unreadable manifest"),
])
def test_latest_falls_back_to_the_newest_checkpoint_that_verifies_naming_the_one_it_skipped(tmp_path, damage, why):
    older, newer = _checkpoint(tmp_path, 4), _checkpoint(tmp_path, 8)
    dense = newer / checkpoints.DENSE
    if damage == "truncate":  # what a power loss leaves of a file whose pages never reached the disk
        os.truncate(dense, 500)
    elif damage == "flip":
        data = bytearray(dense.read_bytes())
        data[10] ^= 0xFF
        dense.write_bytes(bytes(data))
    elif damage == "remove":
        dense.unlink()
    else:
        (newer / checkpoints.MANIFEST).write_text("{\"step\": 8, ")
    with capture_logs() as logged:
        path, manifest = checkpoints.latest(tmp_path)
    assert path == older and manifest.step == 4
    skipped = [event for event in logged if event["event"] == "checkpoint_skipped"]
    assert skipped and skipped[0]["checkpoint"] == str(newer) and why in skipped[0]["why"], skipped


def test_a_manifest_without_files_is_resumed_from_unverified(tmp_path):
    """Checkpoints written before the manifest recorded its files still resume."""
    path = _checkpoint(tmp_path, 4, recorded=False)
    assert checkpoints.read_manifest(path).files == {} and checkpoints.latest(tmp_path)[0] == path


def test_a_manifest_whose_files_are_not_names_and_digests_is_refused(tmp_path):
    path = _checkpoint(tmp_path, 4)
    raw = json.loads((path / checkpoints.MANIFEST).read_text())
    raw["files"] = {"../escape": {"bytes": 1, "sha256": "x"}}
    (path / checkpoints.MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="files must map a file name to its bytes and sha256"):
        checkpoints.read_manifest(path)
    assert checkpoints.latest(tmp_path) is None


def test_a_manifest_whose_fields_have_the_wrong_types_is_refused_as_unreadable(tmp_path):
    """Found by the fuzzer (tests/fuzz, target manifests): a position of 0.0 raised TypeError."""
    path = _checkpoint(tmp_path, 4)
    raw = json.loads((path / checkpoints.MANIFEST).read_text())
    for field, value in (("position", 0.0), ("step", "4"), ("loaders", {}), ("num_ps", -1)):
        (path / checkpoints.MANIFEST).write_text(json.dumps({**raw, field: value}))
        with pytest.raises(ValueError, match="out of range or of the wrong type"):
            checkpoints.read_manifest(path)
