"""A hybridrec cluster as containers on a private Docker network (testcontainers).

Each service runs in the image built by deploy/build-image.sh, hardened the
way docker-compose.yml runs it (read-only root, /tmp on tmpfs, no
capabilities, docker-init as PID 1), named as in deploy/compose/config.yaml
(ps-0, ..., nn-worker-0) by network alias and hostname, with the config
bind-mounted read-only. The test process drives it only through Docker:
`hybridrec health` run inside a container, the NN worker's Stats RPC queried
inside its container, files read with `docker cp`.
"""
from __future__ import annotations

import io
import json
import tarfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import docker
from docker.types import Mount
from testcontainers.core.container import DockerContainer
from testcontainers.core.network import Network

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "deploy" / "compose" / "config.yaml"
PS_SHM_DIR = "/var/lib/hybridrec/shm"
"""ps.shm_dir of deploy/compose/config.yaml (PS stores and embedding-worker buffers)."""


@dataclass(frozen=True)
class Node:
    name: str
    """Container hostname and network alias: the address in the config's cluster section."""
    service: str
    replica: int


PS = [Node("ps-0", "embedding_ps", 0), Node("ps-1", "embedding_ps", 1)]
EMBEDDING_WORKERS = [Node("embedding-worker-0", "embedding_worker", 0)]
NN_WORKERS = [Node("nn-worker-0", "nn_worker", 0), Node("nn-worker-1", "nn_worker", 1)]
DATALOADERS = [Node("dataloader-0", "dataloader", 0), Node("dataloader-1", "dataloader", 1)]
"""The config's cluster.dataloader: each reads its share of the data."""
SERVERS = PS + EMBEDDING_WORKERS + NN_WORKERS
"""Everything but the data loaders, which start last and exit when their data is sent."""

# Queries the NN worker's own Stats RPC from inside its container.
_STATS_SCRIPT = """
import json, grpc
from hybridrec.core.wire.proto import pb
with grpc.insecure_channel("127.0.0.1:50051") as ch:
    stats = ch.unary_unary("/hybridrec.NNWorker/Stats", request_serializer=pb.Empty.SerializeToString,
                           response_deserializer=pb.ServiceStats.FromString)(pb.Empty(), timeout=5)
print(json.dumps(dict(stats.values)))
"""


def make_volume(client: docker.DockerClient, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    client.volumes.create(name, labels={"org.hybridrec.test": "containers"})
    return name


def run_once(client: docker.DockerClient, image: str, args: list[str], volumes: dict[str, dict],
             *, timeout_s: float) -> tuple[int, str]:
    """Run a one-shot container (e.g. `data synth`) to completion; (exit code, logs)."""
    container = client.containers.run(image, args, volumes=volumes, detach=True, init=True,
                                      labels={"org.hybridrec.test": "containers"})
    try:
        code = container.wait(timeout=timeout_s)["StatusCode"]
        return code, container.logs().decode(errors="replace")
    finally:
        container.remove(force=True, v=True)


class Cluster:
    """Starts nodes one by one; `close()` removes every container, volume and the network."""

    def __init__(self, client: docker.DockerClient, image: str, data_volume: str, *,
                 overrides: tuple[str, ...] = (), log_dir: Path | None = None):
        self.client, self.image, self.data_volume = client, image, data_volume
        self.overrides = overrides
        self.log_dir = log_dir
        self.network = Network().create()
        self.results_volume = make_volume(client, "hybridrec-results")
        # checkpoint.dir of the compose config: shared by the PS shards (their dumps), the NN workers (dense
        # state, manifests; the final checkpoint) and the data loader (resume), as a compose volume is.
        self.checkpoints_volume = make_volume(client, "hybridrec-checkpoints")
        self.containers: dict[str, DockerContainer] = {}

    # -- lifecycle ----------------------------------------------------------
    def start(self, node: Node, *, restart: str = "no") -> DockerContainer:
        args = ["serve", node.service, "--config", "/etc/hybridrec/config.yaml", "--replica", str(node.replica)]
        for item in self.overrides:
            args += ["--set", item]
        # ps.shm_dir: the PS store and the embedding worker's buffer of batches live there, on a volume that
        # outlives a restart of the container (both re-attach), as in docker-compose.yml.
        stateful = node.service in ("embedding_ps", "embedding_worker")
        mounts = [Mount(target=PS_SHM_DIR, source=None, type="volume")] if stateful else []
        container = (
            DockerContainer(self.image)
            .with_command(args)
            .with_network(self.network)
            .with_network_aliases(node.name)
            .with_volume_mapping(str(CONFIG), "/etc/hybridrec/config.yaml", "ro")
            .with_volume_mapping(self.data_volume, "/data", "ro")
            .with_volume_mapping(self.results_volume, "/results", "rw")
            .with_volume_mapping(self.checkpoints_volume, "/checkpoints", "rw")
            .with_tmpfs_mount("/tmp")
            .with_kwargs(hostname=node.name, init=True, read_only=True, cap_drop=["ALL"],
                         security_opt=["no-new-privileges:true"], mounts=mounts,
                         restart_policy={"Name": restart}, labels={"org.hybridrec.test": "containers"})
        )
        container.start()
        self.containers[node.name] = container
        return container

    def close(self) -> None:
        for name, container in self.containers.items():
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                (self.log_dir / f"{name}.log").write_text(self.logs(name, tail=None))
            container.stop(force=True, delete_volume=True)  # anonymous PS shm volumes too
        self.containers.clear()
        self.network.remove()
        for volume in (self.results_volume, self.checkpoints_volume):
            self.client.volumes.get(volume).remove(force=True)

    # -- observation --------------------------------------------------------
    def docker(self, name: str):
        return self.containers[name].get_wrapped_container()

    def logs(self, name: str, tail: int | None = 40) -> str:
        try:
            raw = self.docker(name).logs(tail="all" if tail is None else tail)
        except docker.errors.NotFound:
            return "(container gone)"
        return raw.decode(errors="replace")

    def all_logs(self, tail: int = 25) -> str:
        return "\n".join(f"----- {name} (last {tail} lines) -----\n{self.logs(name, tail)}" for name in self.containers)

    def state(self, name: str) -> dict:
        container = self.docker(name)
        container.reload()
        return container.attrs["State"] | {"RestartCount": container.attrs["RestartCount"]}

    def running(self, name: str) -> bool:
        return self.state(name)["Status"] == "running"

    def exec(self, name: str, cmd: list[str]) -> tuple[int, str]:
        result = self.docker(name).exec_run(cmd)
        return result.exit_code, result.output.decode(errors="replace")

    def health(self, name: str) -> str:
        """`hybridrec health` inside the container: SERVING, NOT_SERVING or why it could not ask."""
        if not self.running(name):
            return f"container {self.state(name)['Status']}"
        code, out = self.exec(name, ["hybridrec", "health", "127.0.0.1:50051", "--timeout", "3"])
        lines = out.strip().splitlines()
        return lines[-1] if lines else f"exit code {code}, no output"

    def wait_serving(self, name: str, *, timeout_s: float) -> str:
        """Poll until SERVING; returns the last answer (SERVING or what it was at the deadline)."""
        deadline = time.monotonic() + timeout_s
        answer = "never asked"
        while time.monotonic() < deadline:
            answer = self.health(name)
            if answer == "SERVING" or answer.startswith("container exited"):
                return answer
            time.sleep(1.0)
        return answer

    def nn_stats(self, name: str) -> dict[str, float]:
        code, out = self.exec(name, ["python", "-c", _STATS_SCRIPT])
        if code != 0:
            raise RuntimeError(f"Stats of {name} failed ({code}): {out.strip()[-500:]}")
        return json.loads(out.strip().splitlines()[-1])

    def wait_exit(self, name: str, *, timeout_s: float) -> int | None:
        """Exit code of the container's main process, or None if still running at the deadline."""
        try:
            return self.docker(name).wait(timeout=timeout_s)["StatusCode"]
        except Exception:  # requests' ReadTimeout / ConnectionError on deadline
            return None

    def read_file(self, name: str, path: str) -> bytes:
        """A file from a (possibly exited) container, like `docker cp`."""
        stream, _ = self.docker(name).get_archive(path)
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.getmembers()[0]
            return tar.extractfile(member).read()

    def summary(self) -> dict:
        return json.loads(self.read_file("nn-worker-0", "/results/summary.json"))
