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
    """The PS shards' stores and the embedding worker's batch buffer outlive a restarted process."""
    for name in ("ps-0", "ps-1", "embedding-worker-0"):
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


def test_every_container_has_a_tmpfs_at_tmp(compose):
    """HOME and the numba cache live in /tmp (deploy/README.md): a read-only root needs it writable."""
    for name, service in compose["services"].items():
        assert "/tmp" in service.get("tmpfs", []), name


SERVING = ("export", "inference")


def test_serving_is_a_profile_that_training_does_not_start(compose):
    """`up nn-worker-0` (train.sh) and plain `up` leave export and inference alone; --profile serve adds them."""
    for name, service in compose["services"].items():
        assert (service.get("profiles") == ["serve"]) == (name in SERVING), name
    training = {"nn-worker-0"}
    while True:  # everything `up nn-worker-0` starts: its depends_on, transitively
        more = {dep for name in training for dep in compose["services"][name].get("depends_on", {})} - training
        if not more:
            break
        training |= more
    assert not training & set(SERVING)


def test_export_reads_the_checkpoints_the_nn_workers_write_and_inference_reads_its_bundle(compose, config):
    export, inference = compose["services"]["export"], compose["services"]["inference"]
    root = config["checkpoint"]["dir"]
    for name in ("nn-worker-0", "nn-worker-1"):
        assert f"checkpoints:{root}" in compose["services"][name]["volumes"], name
    assert f"checkpoints:{root}:ro" in export["volumes"]
    script = export["command"][0]
    assert f"hybridrec export {root} --out /models/bundle.new" in script, script
    assert "models:/models" in export["volumes"] and "models:/models:ro" in inference["volumes"]
    command = inference["command"]
    assert command[:4] == ["serve", "inference", "--bundle", "/models/bundle"], command
    assert inference["depends_on"] == {"export": {"condition": "service_completed_successfully"}}
    assert "models" in compose["volumes"]


def test_inference_publishes_on_loopback_only_and_checks_its_health(compose):
    inference = compose["services"]["inference"]
    command = inference["command"]
    settings = dict(command[i + 1].split("=", 1) for i, arg in enumerate(command) if arg == "--set")
    assert settings["host"] == "0.0.0.0"  # inside the container; the host publishes loopback only
    published = {}
    for port in inference["ports"]:
        host, container_port = port.rsplit(":", 1)  # "127.0.0.1:${HYBRIDREC_HTTP_PORT:-8000}:8000"
        assert host.startswith("127.0.0.1:"), port
        published[int(container_port)] = host
    assert set(published) == {int(settings["http_port"]), int(settings["grpc_port"])}
    test = inference["healthcheck"]["test"]
    assert test[:3] == ["CMD", "hybridrec", "health"] and test[3] == f"127.0.0.1:{settings['grpc_port']}", test


def test_named_volumes_mount_over_directories_the_image_gives_the_service_user(compose):
    """A new named volume takes the ownership of the image's directory it is mounted over: a target the
    Dockerfile does not create and chown would be root's, and the non-root services could not write it."""
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    chown = next(line for line in dockerfile.splitlines() if line.strip().startswith('chown "$UID:$UID"'))
    owned = {PurePosixPath(p.rstrip(";\\")) for p in chown.split()[2:]}
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            parts = volume.split(":")
            if len(parts) >= 2 and parts[0] in compose["volumes"] and parts[2:] != ["ro"]:
                assert PurePosixPath(parts[1]) in owned, f"{name}: {volume} (the image chowns {sorted(map(str, owned))})"
