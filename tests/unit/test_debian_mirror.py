"""deploy/debian-mirror.sh finds the Debian archive in apt's sources; no archive host is in the repository."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "deploy" / "debian-mirror.sh"
MAIN = "http://mirror.example/debian"
SECURITY = "http://mirror.example/debian-security"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("awk") is None,
                                reason="needs bash and awk")


def mirror(apt: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "DEBIAN_MIRROR"}
    environ.update(DEBIAN_MIRROR_APT_DIR=str(apt), **env)
    return subprocess.run(["bash", str(HELPER)], env=environ, capture_output=True, text=True, timeout=30)


def apt_dir(tmp_path: Path, sources_list: str | None = None, **parts: str) -> Path:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    if sources_list is not None:
        (apt / "sources.list").write_text(sources_list)
    for name, text in parts.items():
        (apt / "sources.list.d" / name.replace("__", ".")).write_text(text)
    return apt


DEB822 = f"""Types: deb
# a snapshot comment
URIs: {SECURITY}
Suites: bookworm-security
Components: main

Types: deb
URIs: {MAIN}/
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def test_deb822_skips_the_security_archive(tmp_path):
    out = mirror(apt_dir(tmp_path, debian__sources=DEB822))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == MAIN  # trailing slash dropped


def test_one_line_format_with_options(tmp_path):
    text = ("# deb http://old.example/debian bookworm main\n"
            f"deb-src {MAIN}-src bookworm main\n"
            f"deb {SECURITY} bookworm-security main\n"
            f"deb [arch=amd64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {MAIN} trixie main\n")
    out = mirror(apt_dir(tmp_path, text))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == MAIN


def test_sources_list_comes_first_and_disabled_or_foreign_entries_are_skipped(tmp_path):
    apt = apt_dir(
        tmp_path, "deb https://packages.example/apt cloud-sdk-bookworm main\n",
        a__sources="Types: deb\nURIs: https://node.example/node_20.x\nSuites: nodistro\nComponents: main\n",
        b__sources="Enabled: no\nTypes: deb\nURIs: http://disabled.example/debian\nSuites: bookworm\n",
        c__list=f"deb {MAIN} stable main\n",
        d__list__disabled="deb http://ignored.example/debian bookworm main\n",
    )
    out = mirror(apt)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == MAIN


def test_override_and_failure(tmp_path):
    apt = apt_dir(tmp_path, "deb https://node.example/node_20.x nodistro main\n")
    out = mirror(apt)
    assert out.returncode == 1 and out.stdout == ""
    assert "set DEBIAN_MIRROR" in out.stderr and "no Debian archive" in out.stderr
    out = mirror(apt, DEBIAN_MIRROR="http://override.example/debian/")
    assert out.returncode == 0 and out.stdout.strip() == "http://override.example/debian"


def test_scripts_source_the_helper_and_name_no_archive_host():
    for script in (REPO / ".ci" / "compose.sh", REPO / "deploy" / "build-base.sh"):
        assert "debian-mirror.sh" in script.read_text(), script
    hosts = re.compile(r"deb\.debian\.org|debian\.org|pypi\.org|download\.pytorch\.org")
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    found = []
    for name in files:
        path = REPO / name
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        found += [f"{name}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if hosts.search(line)]
    assert not found, "package-archive hosts in the repository:\n" + "\n".join(found)
