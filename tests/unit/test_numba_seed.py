"""The image's compiled numba kernels reach a container's empty cache directory, whole and once
(hybridrec/app/run/numba_seed.py); tests/containers/test_image.py checks that a fresh container then compiles
nothing."""
from __future__ import annotations

from hybridrec.app.run.numba_seed import SEED_ENV, seed


def _image_cache(root):
    source = root / "image-cache"
    (source / "hybridrec").mkdir(parents=True)
    (source / "hybridrec" / "kernel.nbi").write_bytes(b"index")
    (source / "hybridrec" / "kernel.nbc").write_bytes(b"code")
    return source


def test_an_empty_cache_directory_gets_the_images_kernels(tmp_path, monkeypatch):
    source = _image_cache(tmp_path)
    target = tmp_path / "tmp" / "numba-cache"
    monkeypatch.setenv(SEED_ENV, str(source))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(target))
    assert seed()
    assert (target / "hybridrec" / "kernel.nbc").read_bytes() == b"code"
    assert [p.name for p in target.parent.iterdir()] == ["numba-cache"]  # no staging directory left behind


def test_a_cache_directory_that_exists_is_left_alone(tmp_path, monkeypatch):
    source = _image_cache(tmp_path)
    target = tmp_path / "numba-cache"
    (target / "hybridrec").mkdir(parents=True)
    (target / "hybridrec" / "kernel.nbc").write_bytes(b"compiled here")
    monkeypatch.setenv(SEED_ENV, str(source))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(target))
    assert not seed()
    assert (target / "hybridrec" / "kernel.nbc").read_bytes() == b"compiled here"


def test_without_the_images_kernels_nothing_is_copied(tmp_path, monkeypatch):
    target = tmp_path / "numba-cache"
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(target))
    monkeypatch.delenv(SEED_ENV, raising=False)
    assert not seed()
    monkeypatch.setenv(SEED_ENV, str(tmp_path / "missing"))
    assert not seed() and not target.exists()


def test_a_copy_that_fails_leaves_numba_to_compile(tmp_path, monkeypatch):
    source = _image_cache(tmp_path)
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv(SEED_ENV, str(source))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "file" / "numba-cache"))  # its parent is a file
    assert not seed()
