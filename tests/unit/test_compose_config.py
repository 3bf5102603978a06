"""docker-compose.yml gives each container the paths deploy/compose/config.yaml sends it to."""
from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load((REPO / "deploy" / "compose" / "config.yaml").read_text())


def targets(service: dict) -> list[PurePosixPath]:
    """Container paths of a service's mounts ("src:target[:mode]" or an anonymous "target")."""
    out = []
    for volume in service.get("volumes", []):
        parts = volume.split(":") if isinstance(volume, str) else [volume["target"]]
        out.append(PurePosixPath(parts[1] if len(parts) > 1 else parts[0]))
    return out


def mounted(path: str, service: dict) -> bool:
    p = PurePosixPath(path)
    return any(p == t or t in p.parents for t in targets(service))


def test_rank0_sees_what_its_summary_reads_and_writes(compose, config):
    rank0 = compose["services"]["nn-worker-0"]
    assert config["data"].get("oracle"), "the compose data has an oracle; the summary should report it"
    for key, path in (("data.oracle", config["data"]["oracle"]), ("output.dir", config["output"]["dir"])):
        assert mounted(path, rank0), f"nn-worker-0 does not mount {key} ({path}): its summary would lack it"


def test_the_data_loader_sees_the_data(compose, config):
    loader = compose["services"]["dataloader-0"]
    for path in config["data"]["train"] + config["data"]["eval"]:
        assert mounted(path, loader), path


def test_ps_shm_dir_is_a_volume(compose, config):
    for name in ("ps-0", "ps-1"):
        assert mounted(config["ps"]["shm_dir"], compose["services"][name]), name


def test_every_container_is_hardened(compose):
    """Read-only root, no capabilities, no privilege escalation, and an image that runs as a non-root user."""
    for name, service in compose["services"].items():
        assert service.get("read_only") is True, name
        assert service.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in service.get("security_opt", []), name
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text().splitlines()
    users = [line.split()[1] for line in dockerfile if line.startswith("USER ")]
    assert users and not users[-1].startswith(("0", "root")), f"the image's last USER is {users}"
