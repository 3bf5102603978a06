"""docker-compose.yml gives each container the paths deploy/compose/config.yaml (and, in the profile `online`,
deploy/compose/online.yaml) sends it to."""
from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TRAINING = ("ps-0", "ps-1", "embedding-worker-0", "dataloader-0", "dataloader-1", "nn-worker-0", "nn-worker-1")
CONFIG_MOUNT = "${HYBRIDREC_CONFIG:-./deploy/compose/config.yaml}:/etc/hybridrec/config.yaml:ro"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load((REPO / "deploy" / "compose" / "config.yaml").read_text())


def split_volume(volume: str) -> list[str]:
    """"src:target[:mode]" (or an anonymous "target") as its parts; a source may be an interpolation
    such as ${HYBRIDREC_CONFIG:-./deploy/compose/config.yaml}, whose colon separates nothing."""
    source = re.match(r"\$\{[^}]*\}", volume)
    if source:
        return [source.group(0)] + volume[source.end() + 1:].split(":")
    return volume.split(":")


def targets(service: dict) -> list[PurePosixPath]:
    """Container paths of a service's mounts ("src:target[:mode]" or an anonymous "target")."""
    out = []
    for volume in service.get("volumes", []):
        parts = split_volume(volume) if isinstance(volume, str) else [volume["target"]]
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


def test_every_data_loader_sees_the_data(compose, config):
    for loader in range(len(config["cluster"]["dataloader"])):
        service = compose["services"][f"dataloader-{loader}"]
        for path in config["data"]["train"] + config["data"]["eval"]:
            assert mounted(path, service), path


@pytest.mark.parametrize("job", ["config.yaml", "online.yaml"])
def test_a_data_loader_service_per_listed_loader_in_replica_order(compose, job):
    """cluster.dataloader lists L loaders (every service reads it: the NN workers keep an inbox per loader); the
    compose file runs exactly those: dataloader-<l> at the listed address with --replica l, each started
    before the NN workers, and no other loader."""
    listed = yaml.safe_load((REPO / "deploy" / "compose" / job).read_text())["cluster"]["dataloader"]
    services = sorted(name for name in compose["services"] if name.startswith("dataloader-"))
    assert len(listed) >= 2, "the compose cluster runs several data loaders"
    assert services == [f"dataloader-{loader}" for loader in range(len(listed))]
    for loader, address in enumerate(listed):
        service = compose["services"][f"dataloader-{loader}"]
        assert address == f"{service['hostname']}:50051" and service["hostname"] == f"dataloader-{loader}"
        command = service["command"]
        assert command[:2] == ["serve", "dataloader"] and command[command.index("--replica") + 1] == str(loader)
        for rank in ("nn-worker-0", "nn-worker-1"):
            assert f"dataloader-{loader}" in compose["services"][rank]["depends_on"], rank


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
ONLINE = ("nats", "replay", "inference-online")


def test_serving_and_online_are_profiles_that_training_does_not_start(compose):
    """`up nn-worker-0` (train.sh) and plain `up` leave export, inference and the online services alone;
    --profile serve and --profile online add them."""
    for name, service in compose["services"].items():
        assert (service.get("profiles") == ["serve"]) == (name in SERVING), name
        assert (service.get("profiles") == ["online"]) == (name in ONLINE), name
    training = {"nn-worker-0"}
    while True:  # everything `up nn-worker-0` starts: its depends_on, transitively
        more = {dep for name in training for dep in compose["services"][name].get("depends_on", {})} - training
        if not more:
            break
        training |= more
    assert training == set(TRAINING) | {"synth"}
    assert not training & (set(SERVING) | set(ONLINE))


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
    assert command[:6] == ["serve", "inference", "--engine", "${HYBRIDREC_ENGINE:-builtin}", "--bundle",
                           "/models/bundle"], command
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
    test = inference["healthcheck"]["test"]  # REST readiness, which both engines (builtin, triton) answer
    assert test[:3] == ["CMD", "python", "-c"], test
    assert f"'http://127.0.0.1:{settings['http_port']}/v2/health/ready'" in test[3], test


def test_named_volumes_mount_over_directories_the_image_gives_the_service_user(compose):
    """A new named volume takes the ownership of the image's directory it is mounted over: a target the
    Dockerfile does not create and chown would be root's, and the non-root services could not write it."""
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    chown = next(line for line in dockerfile.splitlines() if line.strip().startswith('chown "$UID:$UID"'))
    owned = {PurePosixPath(p.rstrip(";\\")) for p in chown.split()[2:]}
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            parts = split_volume(volume)
            if len(parts) >= 2 and parts[0] in compose["volumes"] and parts[2:] != ["ro"]:
                assert PurePosixPath(parts[1]) in owned, f"{name}: {volume} (the image chowns {sorted(map(str, owned))})"


# --- profile "online": deploy/compose/online.yaml --------------------------------------------------------------

@pytest.fixture(scope="module")
def online() -> dict:
    return yaml.safe_load((REPO / "deploy" / "compose" / "online.yaml").read_text())


def test_every_training_container_mounts_the_job_config_hybridrec_config_names(compose):
    """HYBRIDREC_CONFIG picks the job config of every training container (and of nats, whose healthcheck creates
    the stream it names); unset, it is config.yaml, so `up`, `up nn-worker-0` and train.sh are as they were."""
    for name in TRAINING + ("nats",):
        assert CONFIG_MOUNT in compose["services"][name]["volumes"], name
    for name in ("synth", "replay", "export", "inference", "inference-online"):
        assert not any("/etc/hybridrec" in str(v) for v in compose["services"][name].get("volumes", [])), name


def test_both_job_configs_load(tmp_path):
    from hybridrec.core.config import load_config

    files = load_config(REPO / "deploy" / "compose" / "config.yaml")
    stream = load_config(REPO / "deploy" / "compose" / "online.yaml")
    assert files.data.stream is None and files.data.train == ["/data/train.tsv"] and not files.publish.enabled
    assert stream.data.stream is not None and stream.data.train == [] and stream.publish.enabled
    assert stream.data.stream.until_event is not None, "without an end the online job never finishes"


def test_the_online_config_differs_from_the_file_config_only_in_data_checkpoint_and_publish(config, online):
    assert set(online) - set(config) == {"publish"}
    for section in set(config) - {"data", "checkpoint"}:
        assert online[section] == config[section], section
    assert {k: v for k, v in online["data"].items() if k != "stream"} == \
        {k: v for k, v in config["data"].items() if k != "train"}
    # a job of its own: neither job resumes from the other's checkpoints
    assert online["checkpoint"]["dir"] != config["checkpoint"]["dir"]
    assert online["checkpoint"]["job_id"] != config["checkpoint"]["job_id"]


def test_the_online_job_reads_what_replay_publishes_on_the_nats_service(compose, online):
    stream = online["data"]["stream"]
    nats = compose["services"]["nats"]
    command = nats["command"]
    assert nats["entrypoint"] == ["nats-server"] and "-js" in command
    port = command[command.index("-p") + 1]
    assert stream["url"] == f"nats://{nats['hostname']}:{port}"
    assert "ports" not in nats, "the broker has no authentication: it must not be published"
    store = command[command.index("-sd") + 1]
    assert f"nats:{store}" in nats["volumes"] and "nats" in compose["volumes"], "the JetStream store is a volume"
    check = nats["healthcheck"]["test"]
    assert check[:2] == ["CMD", "python"] and "create_stream(" in check[-1]
    assert "len(c.cluster.dataloader)" in check[-1], "the stream holds a partition per data loader"

    replay = compose["services"]["replay"]
    args = replay["command"]
    assert args[:2] == ["data", "replay"]
    assert args[args.index("--to") + 1] == f"{stream['url']}/{stream['subject']}"
    assert "--rate" in args
    assert args[args.index("--partitions") + 1] == str(len(online["cluster"]["dataloader"])), "one per loader"
    [published] = [a for a in args[2:] if a.startswith("/")]
    assert published == "/data/train.tsv" and mounted(published, replay)
    assert replay["depends_on"] == {"synth": {"condition": "service_completed_successfully"},
                                    "nats": {"condition": "service_healthy"}}
    # the job ends with the last replayed event: until_event is the synthetic set's default row count
    default_rows = re.fullmatch(r"\$\{HYBRIDREC_SYNTH_ROWS:-(\d+)\}",
                                compose["services"]["synth"]["environment"]["HYBRIDREC_SYNTH_ROWS"])
    assert default_rows and stream["until_event"] == int(default_rows.group(1))


def test_the_online_job_writes_versions_inference_online_follows_and_the_stream_account(compose, online):
    root = online["publish"]["dir"]
    for name in ("ps-0", "ps-1", "nn-worker-0"):  # every PS shard and NN worker rank 0 write a version's parts
        service = compose["services"][name]
        assert mounted(root, service), f"{name} does not mount publish.dir {root}"
        [parts] = [p for p in map(split_volume, service["volumes"])
                   if len(p) > 1 and PurePosixPath(root).is_relative_to(p[1])]
        assert parts[2:] != ["ro"], f"{name}: {':'.join(parts)} is read-only"
    follower = compose["services"]["inference-online"]
    command = follower["command"]
    assert command[:4] == ["serve", "inference", "--follow", root], command
    assert mounted(root, follower) and "models:/models:ro" in follower["volumes"]
    settings = dict(command[i + 1].split("=", 1) for i, arg in enumerate(command) if arg == "--set")
    for port in follower["ports"]:
        host, container_port = port.rsplit(":", 1)
        assert host.startswith("127.0.0.1:") and int(container_port) in {int(settings["http_port"]),
                                                                          int(settings["grpc_port"])}, port
    assert f"127.0.0.1:{settings['http_port']}/v2/health/ready" in follower["healthcheck"]["test"][-1]
    # each data loader writes stream-<l>.json into output.dir, next to rank 0's summary
    for loader in range(len(online["cluster"]["dataloader"])):
        service = compose["services"][f"dataloader-{loader}"]
        assert mounted(online["output"]["dir"], service)
        assert f"results:{online['output']['dir']}" in service["volumes"]
