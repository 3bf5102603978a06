"""The Kubernetes manifests (deploy/k8s) render and are valid, offline.

Renders the kustomize base and the GPU overlay with `kubectl kustomize`,
validates every object against the Kubernetes JSON schemas bundled with the
`kubernetes-validate` package (strict: unknown fields are errors), and checks
the facts the deployment relies on: probes, the in-memory shm volume of the
PS, replica counts that agree with the config's cluster section, a hybridrec
config that loads, and what the GPU overlay adds. The online overlay (NATS
broker, replay, the data loader on the stream) is checked the same way. Serving (deploy/k8s/serving,
alone and with the base in overlays/serving) gets the same validation and
checks. The KServe example (deploy/k8s/kserve) is of custom resources that
kubernetes-validate has no schema for: a structural test checks its fields
instead, and validates its container strictly as a Pod's. Needs kubectl, no
cluster and no Docker.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
KUBERNETES_VERSION = "1.32"
"""Schemas of this Kubernetes release (the oldest we promise to run on)."""
STATEFULSETS = {
    # StatefulSet name -> (config cluster key, hybridrec service)
    "ps": ("ps", "embedding_ps"),
    "embedding-worker": ("embedding_workers", "embedding_worker"),
    "nn-worker": ("nn_workers", "nn_worker"),
}
GRPC_PORT = 50051


def render(path: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: it renders deploy/k8s (`kubectl kustomize`); "
                    "install it (Debian package kubernetes-client or the upstream binary)")
    proc = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return render(K8S / "base")


@pytest.fixture(scope="module")
def gpu() -> list[dict]:
    return render(K8S / "overlays" / "gpu")


@pytest.fixture(scope="module")
def ps_replicas() -> list[dict]:
    return render(K8S / "overlays" / "ps-replicas")


@pytest.fixture(scope="module")
def online() -> list[dict]:
    return render(K8S / "overlays" / "online")


@pytest.fixture(scope="module")
def serving() -> list[dict]:
    return render(K8S / "serving")


@pytest.fixture(scope="module")
def serving_overlay() -> list[dict]:
    return render(K8S / "overlays" / "serving")


def one(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def hybridrec_config(objects: list[dict]) -> dict:
    maps = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("hybridrec-config")]
    assert len(maps) == 1, "expected one generated ConfigMap hybridrec-config-<hash>"
    return yaml.safe_load(maps[0]["data"]["config.yaml"])


@pytest.mark.parametrize("variant", ["base", "gpu", "ps_replicas", "online", "serving", "serving_overlay"])
def test_every_object_validates_against_the_kubernetes_schemas(variant, request):
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("the test extra `kubernetes-validate` is not installed (pip install kubernetes-validate)")
    objects = request.getfixturevalue(variant)
    assert objects, f"{variant} rendered no objects"
    errors = []
    for obj in objects:
        name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            errors.append(f"{name}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"{name}: {exc.message}")
    assert not errors, "objects that do not validate:\n" + "\n".join(errors)


def test_base_has_the_expected_objects(base):
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in base if o["kind"] != "ConfigMap")
    assert kinds == sorted([
        ("Job", "dataloader"),
        ("PersistentVolumeClaim", "hybridrec-state"),
        ("Service", "dataloader"), ("Service", "embedding-worker"), ("Service", "nn-worker"), ("Service", "ps"),
        ("StatefulSet", "embedding-worker"), ("StatefulSet", "nn-worker"), ("StatefulSet", "ps"),
        ("NetworkPolicy", "embedding-ps"), ("NetworkPolicy", "embedding-worker"),
        ("NetworkPolicy", "hybridrec-default-deny"), ("NetworkPolicy", "hybridrec-metrics"),
        ("NetworkPolicy", "nn-worker"),
    ])


def test_config_map_is_a_valid_hybridrec_config(base):
    from hybridrec.core.config import from_dict

    config = from_dict(hybridrec_config(base), source="deploy/k8s/base/config.yaml")
    assert config.output.dir == "/results"
    assert config.checkpoint.dir == "/checkpoints"


@pytest.mark.parametrize("name", sorted(STATEFULSETS))
def test_statefulsets_match_the_cluster_section(base, name):
    """Replicas, headless service and per-ordinal addresses agree with the config."""
    key, service = STATEFULSETS[name]
    cluster = hybridrec_config(base)["cluster"]
    sts = one(base, "StatefulSet", name)
    svc = one(base, "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None", f"Service {svc['metadata']['name']} must be headless"
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert sts["spec"]["replicas"] == len(cluster[key]), (
        f"StatefulSet {name} has {sts['spec']['replicas']} replicas, cluster.{key} lists {len(cluster[key])}")
    assert cluster[key] == [f"{name}-{i}.{svc['metadata']['name']}:{GRPC_PORT}"
                            for i in range(sts["spec"]["replicas"])]
    container = pod_spec(sts)["containers"][0]
    assert container["args"][:2] == ["serve", service]
    assert "--replica" not in container["args"], "the replica must come from the pod ordinal (hostname)"


def test_rendezvous_is_rank_zero(base):
    cluster = hybridrec_config(base)["cluster"]
    assert cluster["rendezvous"] == "nn-worker-0.nn-worker:29500"
    ports = {p["containerPort"] for p in pod_spec(one(base, "StatefulSet", "nn-worker"))["containers"][0]["ports"]}
    assert 29500 in ports


@pytest.mark.parametrize("variant", ["base", "online"])
def test_the_data_loaders_are_an_indexed_job_of_the_listed_loaders(variant, request):
    """cluster.dataloader lists L ≥ 2 loaders; the Job runs exactly L pods at once, pod l named dataloader-<l>
    (an Indexed Job's hostname) at the listed address through the headless Service, with replica l."""
    objects = request.getfixturevalue(variant)
    job = one(objects, "Job", "dataloader")
    spec = pod_spec(job)
    listed = hybridrec_config(objects)["cluster"]["dataloader"]
    assert len(listed) >= 2, "the Kubernetes cluster runs several data loaders"
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == len(listed)
    assert "hostname" not in spec, "an Indexed Job names pod l dataloader-<l> itself"
    assert listed == [f"{job['metadata']['name']}-{l}.{spec['subdomain']}:{GRPC_PORT}" for l in range(len(listed))]
    assert one(objects, "Service", spec["subdomain"])["spec"]["clusterIP"] == "None"
    assert spec["restartPolicy"] in ("OnFailure", "Never")
    container = {c["name"]: c for c in spec["containers"]}["dataloader"]
    assert container["args"][:2] == ["serve", "dataloader"] and "--replica" not in container["args"]
    [replica] = [e for e in container["env"] if e["name"] == "HYBRIDREC_REPLICA"]
    assert replica["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    [synth] = [c for c in spec["initContainers"] if "hybridrec data synth" in " ".join(c.get("args", []))]
    assert '[ "$JOB_COMPLETION_INDEX" = 0 ]' in synth["args"][0], "one pod writes the data, the others wait"
    if variant == "online":  # a partition per loader: the replay and the stream's subjects
        [replay] = pod_spec(one(objects, "Job", "replay"))["containers"]
        assert replay["args"][replay["args"].index("--partitions") + 1] == str(len(listed))


def workloads(objects):
    return [o for o in objects if o["kind"] in ("StatefulSet", "Job", "Deployment")]


def test_grpc_probes(base):
    for obj in workloads(base):
        for c in pod_spec(obj)["containers"]:
            assert c["readinessProbe"]["grpc"]["port"] == GRPC_PORT, f"{obj['metadata']['name']}: readiness"
            if obj["kind"] == "StatefulSet":
                assert c["livenessProbe"]["grpc"]["port"] == GRPC_PORT, f"{obj['metadata']['name']}: liveness"
                assert c["startupProbe"]["grpc"]["port"] == GRPC_PORT, f"{obj['metadata']['name']}: startup"


@pytest.mark.parametrize("name", ["ps", "embedding-worker"])  # the stores; the batch buffer
def test_ps_shm_is_an_in_memory_empty_dir_at_the_configured_path(base, name):
    shm_dir = hybridrec_config(base)["ps"]["shm_dir"]
    spec = pod_spec(one(base, "StatefulSet", name))
    mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
    assert shm_dir in mounts, f"nothing mounted at ps.shm_dir {shm_dir}"
    volume = next(v for v in spec["volumes"] if v["name"] == mounts[shm_dir])
    assert volume.get("emptyDir", {}).get("medium") == "Memory"


def test_checkpoints_and_results_on_the_pvc(base):
    config = hybridrec_config(base)
    for name, path in [("ps", config["checkpoint"]["dir"]), ("nn-worker", config["checkpoint"]["dir"]),
                       ("nn-worker", config["output"]["dir"])]:
        spec = pod_spec(one(base, "StatefulSet", name))
        mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
        assert path in mounts, f"{name}: nothing mounted at {path}"
        volume = next(v for v in spec["volumes"] if v["name"] == mounts[path])
        assert volume["persistentVolumeClaim"]["claimName"] == "hybridrec-state"


@pytest.mark.parametrize("variant", ["base", "online", "serving"])
def test_hardening_and_resources(variant, request):
    for obj in workloads(request.getfixturevalue(variant)):
        spec = pod_spec(obj)
        name = obj["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec.get("automountServiceAccountToken") is False, name
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, f"{name}/{c['name']}"
            assert sc["readOnlyRootFilesystem"] is True, f"{name}/{c['name']}"
            assert sc["capabilities"]["drop"] == ["ALL"], f"{name}/{c['name']}"
            for what in ("requests", "limits"):
                assert {"cpu", "memory"} <= c["resources"][what].keys(), f"{name}/{c['name']}: {what}"
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert "/tmp" in mounts, f"{name}/{c['name']}: a read-only root needs a writable /tmp"


def test_gpu_overlay_puts_nn_workers_on_gpus_with_nccl(base, gpu):
    sts = one(gpu, "StatefulSet", "nn-worker")
    container = pod_spec(sts)["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert "NCCL_SOCKET_IFNAME" in env and "NCCL_DEBUG" in env
    args = container["args"]
    assert args[:2] == ["serve", "nn_worker"]
    assert "training.backend=nccl" in args and args[args.index("training.backend=nccl") - 1] == "--set"
    dshm = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}.get("/dev/shm")
    assert dshm and next(v for v in pod_spec(sts)["volumes"] if v["name"] == dshm)["emptyDir"]["medium"] == "Memory"
    # base probes, mounts and hardening are kept, and nothing else gets a GPU
    base_container = pod_spec(one(base, "StatefulSet", "nn-worker"))["containers"][0]
    assert container["readinessProbe"] == base_container["readinessProbe"]
    assert {m["mountPath"] for m in base_container["volumeMounts"]} < {m["mountPath"] for m in container["volumeMounts"]}
    for obj in workloads(gpu):
        if obj["metadata"]["name"] != "nn-worker":
            for c in pod_spec(obj)["containers"]:
                assert "nvidia.com/gpu" not in c["resources"].get("limits", {}), obj["metadata"]["name"]
    assert sts["spec"]["replicas"] == len(hybridrec_config(gpu)["cluster"]["nn_workers"])


def _allowed(policies: list[dict], source: dict, target: dict, port: str) -> bool:
    """Whether ingress from pods labelled `source` (namespace labels under "ns") reaches `target` on `port`.

    The NetworkPolicy rules: a pod selected by no policy is open; a selected pod admits what any of its
    policies' rules admit (a rule without `ports` covers every port, one without `from` every peer).
    """
    def matches(selector: dict, labels: dict) -> bool:
        return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())

    selecting = [p for p in policies if matches(p["spec"]["podSelector"], target)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports = [p["port"] for p in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            peers = rule.get("from")
            if peers is None:
                return True
            for peer in peers:
                if "namespaceSelector" in peer and matches(peer["namespaceSelector"], source.get("ns", {})):
                    return True
                if "podSelector" in peer and "namespaceSelector" not in peer and not source.get("ns") \
                        and matches(peer["podSelector"], source):
                    return True
    return False


def test_network_policies_let_each_port_be_reached_only_by_its_callers(base):
    policies = [o for o in base if o["kind"] == "NetworkPolicy"]
    pods = {c: {"app.kubernetes.io/name": "hybridrec", "app.kubernetes.io/component": c}
            for c in ("embedding-ps", "embedding-worker", "nn-worker", "dataloader")}
    callers = {  # target -> the components that call its gRPC port
        "embedding-ps": {"embedding-worker", "nn-worker"},
        "embedding-worker": {"dataloader", "nn-worker"},
        "nn-worker": {"dataloader", "nn-worker"},
        "dataloader": set(),
    }
    for target, allowed in callers.items():
        for source in pods:
            assert _allowed(policies, pods[source], pods[target], "grpc") == (source in allowed), (source, target)
        outsider = {"app.kubernetes.io/name": "other"}
        assert not _allowed(policies, outsider, pods[target], "grpc"), target
        monitoring = {"ns": {"kubernetes.io/metadata.name": "monitoring"}}
        assert _allowed(policies, monitoring, pods[target], "metrics"), target
        assert not _allowed(policies, monitoring, pods[target], "grpc"), target
    # Gloo and the rendezvous store: NN workers reach each other on any port, nobody else does
    assert _allowed(policies, pods["nn-worker"], pods["nn-worker"], 29500)
    assert not _allowed(policies, pods["dataloader"], pods["nn-worker"], 29500)
    assert not _allowed(policies, pods["embedding-ps"], pods["nn-worker"], 41234)


def test_ps_replicas_overlay_keeps_a_shards_two_copies_on_different_nodes(base, ps_replicas, tmp_path):
    """overlays/ps-replicas: ps.replicas 2 on the PS command line (a config that loads), PS pods required on
    distinct nodes (pod ps-i holds shard i and the backup of shard i-1), memory and shm doubled, and the PS pods
    admitted to each other's gRPC port; nothing else changes."""
    from hybridrec.core.config import load_config

    ps, ps_base = one(ps_replicas, "StatefulSet", "ps"), one(base, "StatefulSet", "ps")
    (container,), (base_container,) = pod_spec(ps)["containers"], pod_spec(ps_base)["containers"]
    args = container["args"]
    assert args[:4] == base_container["args"][:4] and args[4:] == ["--set", "ps.replicas=2"], args
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(hybridrec_config(ps_replicas)))
    config = load_config(tmp_path / "config.yaml", [args[5]])  # as the PS reads it
    assert config.ps.replicas == 2 and len(config.cluster.ps) == ps["spec"]["replicas"] >= 2
    (term,) = pod_spec(ps)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    labels = ps["spec"]["template"]["metadata"]["labels"]
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()

    def gib(quantity: str) -> float:
        return float(quantity.removesuffix("Gi"))

    for kind in ("requests", "limits"):
        assert gib(container["resources"][kind]["memory"]) >= 2 * gib(base_container["resources"][kind]["memory"])
    shm = {v["name"]: v for v in pod_spec(ps)["volumes"]}["shm"]["emptyDir"]
    base_shm = {v["name"]: v for v in pod_spec(ps_base)["volumes"]}["shm"]["emptyDir"]
    assert shm["medium"] == "Memory" and gib(shm["sizeLimit"]) == 2 * gib(base_shm["sizeLimit"])
    policies = [o for o in ps_replicas if o["kind"] == "NetworkPolicy"]
    pods = {c: {"app.kubernetes.io/name": "hybridrec", "app.kubernetes.io/component": c}
            for c in ("embedding-ps", "embedding-worker", "nn-worker", "dataloader")}
    assert _allowed(policies, pods["embedding-ps"], pods["embedding-ps"], "grpc")
    assert not _allowed(policies, pods["dataloader"], pods["embedding-ps"], "grpc")
    assert not _allowed(policies, pods["embedding-ps"], pods["nn-worker"], "grpc")
    changed = {(o["kind"], o["metadata"]["name"]) for o in ps_replicas} ^ {(o["kind"], o["metadata"]["name"])
                                                                          for o in base}
    assert not changed, changed


# --- online training: deploy/k8s/components/online, overlays/online -------------------------------------------

def names(objects: list[dict]) -> set[tuple[str, str]]:
    """(kind, name) of every object, a generated ConfigMap without its hash suffix."""
    return {(o["kind"], o["metadata"]["name"].rsplit("-", 1)[0] if o["kind"] == "ConfigMap" else o["metadata"]["name"])
            for o in objects}


def test_online_overlay_adds_the_broker_and_the_replay_and_changes_only_the_config_and_the_loader(base, online):
    assert names(online) - names(base) == {("StatefulSet", "nats"), ("Service", "nats"), ("Job", "replay"),
                                           ("NetworkPolicy", "nats"), ("ConfigMap", "nats-stream-ready")}
    assert names(base) <= names(online)

    def unhashed(obj: dict) -> str:  # the replaced config gets another hash suffix: every pod mounts it
        return re.sub(r"hybridrec-config-[a-z0-9]+", "hybridrec-config", json.dumps(obj, sort_keys=True))

    changed = [o for o in base if o["kind"] != "ConfigMap"
               and unhashed(o) != unhashed(one(online, o["kind"], o["metadata"]["name"]))]
    assert [(o["kind"], o["metadata"]["name"]) for o in changed] == [("Job", "dataloader")]
    for obj in online:
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "hybridrec", obj["metadata"]["name"]


def test_online_config_trains_the_stream_of_the_nats_service(base, online):
    from hybridrec.core.config import from_dict

    tree, base_tree = hybridrec_config(online), hybridrec_config(base)
    config = from_dict(tree, source="deploy/k8s/components/online/config.yaml")
    stream = config.data.stream
    assert stream is not None and config.data.train == [] and stream.until_event is not None
    svc = one(online, "Service", "nats")
    [port] = [p["port"] for p in svc["spec"]["ports"] if p["name"] == "client"]
    assert stream.url == f"nats://{svc['metadata']['name']}:{port}", stream.url
    # the same job otherwise: cluster, model, training and paths as the base's, and a checkpoint id of its own
    for section in set(base_tree) - {"data", "checkpoint"}:
        assert tree.get(section) == base_tree[section], section
    assert {k: v for k, v in tree["data"].items() if k != "stream"} == \
        {k: v for k, v in base_tree["data"].items() if k != "train"}
    assert tree["checkpoint"]["job_id"] != base_tree["checkpoint"]["job_id"]
    # the replay publishes where the loader reads: the broker's URL and the stream's subject
    [replay] = pod_spec(one(online, "Job", "replay"))["containers"]
    assert replay["args"][:3] == ["data", "replay", "/data/train.tsv"]
    assert replay["args"][replay["args"].index("--to") + 1] == f"{stream.url}/{stream.subject}"


def test_nats_is_a_statefulset_with_its_store_on_a_persistent_volume(online):
    sts = one(online, "StatefulSet", "nats")
    svc = one(online, "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["replicas"] == 1
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    [container] = pod_spec(sts)["containers"]
    assert container["command"] == ["nats-server"] and "-js" in container["args"]
    args = container["args"]
    store = args[args.index("-sd") + 1]
    [claim] = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[store] == claim["metadata"]["name"], "the JetStream store must be the claimed volume"
    assert claim["metadata"]["name"] not in {v["name"] for v in pod_spec(sts).get("volumes", [])}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["client"] == int(args[args.index("-p") + 1])
    assert ports["monitor"] == int(args[args.index("-m") + 1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == "monitor" and \
            container[probe]["httpGet"]["path"].startswith("/healthz"), probe
    assert container["image"].startswith("hybridrec"), "clusters here are offline: nats-server is in our image"


def test_the_data_loader_and_the_replay_wait_for_the_stream(online, base):
    config = hybridrec_config(online)
    loader = pod_spec(one(online, "Job", "dataloader"))
    base_loader = pod_spec(one(base, "Job", "dataloader"))
    scripts = {v["name"]: v for v in loader["volumes"]}["scripts"]["configMap"]["name"]
    assert scripts.startswith("nats-stream-ready-")
    stream_init = {c["name"]: c for c in loader["initContainers"]}["stream"]
    assert stream_init["command"] == ["python", "/etc/hybridrec-online/stream-ready.py"]
    assert {m["mountPath"] for m in stream_init["volumeMounts"]} >= {"/etc/hybridrec", "/etc/hybridrec-online"}
    assert {c["name"] for c in base_loader["initContainers"]} < {c["name"] for c in loader["initContainers"]}
    [container] = loader["containers"]
    results = mounts_of(loader, container)[config["output"]["dir"]]  # stream.json goes there
    assert results["persistentVolumeClaim"]["claimName"] == "hybridrec-state" and results["subPath"] == "results"
    assert not results["readOnly"]
    replay = pod_spec(one(online, "Job", "replay"))
    assert one(online, "Job", "replay")["spec"]["backoffLimit"] == 0 and replay["restartPolicy"] == "Never", \
        "a replay run again publishes the file again"
    [wait] = replay["initContainers"]
    assert "/data/oracle.json" in " ".join(wait["args"]) and "stream-ready.py" in " ".join(wait["args"])
    [publisher] = replay["containers"]
    data = mounts_of(replay, publisher)["/data"]
    written = mounts_of(base_loader, {c["name"]: c for c in base_loader["initContainers"]}["synth"])["/data"]
    assert data["persistentVolumeClaim"] == written["persistentVolumeClaim"] and data["subPath"] == written["subPath"]
    assert data["readOnly"]


def test_only_the_data_loader_and_the_replay_reach_nats(online):
    policies = [o for o in online if o["kind"] == "NetworkPolicy"]
    pods = {c: {"app.kubernetes.io/name": "hybridrec", "app.kubernetes.io/component": c}
            for c in ("nats", "replay", "dataloader", "embedding-ps", "embedding-worker", "nn-worker")}
    for source in pods:
        assert _allowed(policies, pods[source], pods["nats"], "client") == (source in ("dataloader", "replay")), source
        assert not _allowed(policies, pods[source], pods["nats"], "monitor"), source
        assert not _allowed(policies, pods[source], pods["replay"], "client"), source
    assert not _allowed(policies, {"app.kubernetes.io/name": "other"}, pods["nats"], "client")
    assert not _allowed(policies, {"ns": {"kubernetes.io/metadata.name": "monitoring"}}, pods["nats"], "client")
    # the base's paths are as they were
    assert _allowed(policies, pods["dataloader"], pods["embedding-worker"], "grpc")
    assert not _allowed(policies, pods["replay"], pods["embedding-worker"], "grpc")


# --- serving: deploy/k8s/serving, overlays/serving, kserve ------------------------------------------------------

def settings_of(args: list[str]) -> dict[str, str]:
    """The `--set key=value` settings of a `hybridrec serve inference` command line."""
    return dict(args[i + 1].split("=", 1) for i, arg in enumerate(args) if arg == "--set")


def mounts_of(spec: dict, container: dict) -> dict[str, dict]:
    """mountPath -> {volume's source, subPath, readOnly} of a container."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    return {m["mountPath"]: {**volumes[m["name"]], "subPath": m.get("subPath"), "readOnly": m.get("readOnly", False)}
            for m in container["volumeMounts"]}


def test_serving_has_the_expected_objects_and_the_overlay_adds_them_to_the_base(base, serving, serving_overlay):
    names = sorted((o["kind"], o["metadata"]["name"]) for o in serving)
    assert names == sorted([("Deployment", "inference"), ("Job", "export"), ("Service", "inference"),
                            ("NetworkPolicy", "inference"), ("NetworkPolicy", "export")])
    overlay = sorted((o["kind"], o["metadata"]["name"]) for o in serving_overlay)
    assert overlay == sorted(names + [(o["kind"], o["metadata"]["name"]) for o in base])
    for obj in serving:
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "hybridrec", obj["metadata"]["name"]
    assert not [o for o in serving if o["kind"] in ("PersistentVolumeClaim", "ConfigMap")], \
        "serving reuses the base's PVC and needs no job config"


def test_export_writes_the_bundle_inference_reads_from_the_checkpoints_training_writes(base, serving):
    config = hybridrec_config(base)
    rank0 = pod_spec(one(base, "StatefulSet", "nn-worker"))
    trained = mounts_of(rank0, rank0["containers"][0])
    job = one(serving, "Job", "export")
    spec = pod_spec(job)
    assert spec["restartPolicy"] in ("OnFailure", "Never")
    [export] = spec["containers"]
    exported = mounts_of(spec, export)
    for path in (config["checkpoint"]["dir"], config["output"]["dir"]):  # same PVC and subPath, read-only
        assert exported[path]["persistentVolumeClaim"] == trained[path]["persistentVolumeClaim"], path
        assert exported[path]["subPath"] == trained[path]["subPath"] and exported[path]["readOnly"], path
    script = " ".join(export["args"])
    assert f"{config['output']['dir']}/summary.json" in script, "export must wait for the end of training"
    assert f"hybridrec export {config['checkpoint']['dir']} --out /models/bundle.new" in script
    assert "mv /models/bundle.new /models/bundle" in script
    models = exported["/models"]
    assert models["persistentVolumeClaim"]["claimName"] == "hybridrec-state" and not models["readOnly"]

    deployment = one(serving, "Deployment", "inference")
    spec = pod_spec(deployment)
    [inference] = spec["containers"]
    assert inference["args"][:4] == ["serve", "inference", "--bundle", "/models/bundle"]
    for container in [inference] + spec["initContainers"]:
        served = mounts_of(spec, container)["/models"]
        assert served["persistentVolumeClaim"]["claimName"] == "hybridrec-state", container["name"]
        assert served["subPath"] == models["subPath"] and served["readOnly"], container["name"]
    [wait] = spec["initContainers"]
    assert "/models/bundle/manifest.json" in " ".join(wait["args"])


def test_inference_ports_probes_and_service(serving):
    deployment = one(serving, "Deployment", "inference")
    [c] = pod_spec(deployment)["containers"]
    settings = settings_of(c["args"])
    assert settings["host"] == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": int(settings["http_port"]), "grpc": int(settings["grpc_port"]),
                     "metrics": int(settings["metrics_port"])}
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    svc = one(serving, "Service", "inference")
    assert svc["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert deployment["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {"http": "http", "grpc": "grpc"}


def test_network_policies_open_inference_to_the_namespace_only(serving, serving_overlay):
    pods = {c: {"app.kubernetes.io/name": "hybridrec", "app.kubernetes.io/component": c}
            for c in ("inference", "export", "embedding-ps", "nn-worker")}
    client = {"app": "some-frontend"}  # any pod of this namespace
    elsewhere = {"ns": {"kubernetes.io/metadata.name": "other"}}
    monitoring = {"ns": {"kubernetes.io/metadata.name": "monitoring"}}
    for objects in (serving, serving_overlay):
        policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
        for port in ("http", "grpc"):
            assert _allowed(policies, client, pods["inference"], port)
            assert not _allowed(policies, elsewhere, pods["inference"], port)
        assert _allowed(policies, monitoring, pods["inference"], "metrics")
        assert not _allowed(policies, client, pods["inference"], "metrics")
        assert not _allowed(policies, client, pods["export"], "http")
    # serving adds nothing to the training pods' ingress
    policies = [o for o in serving_overlay if o["kind"] == "NetworkPolicy"]
    assert not _allowed(policies, pods["inference"], pods["embedding-ps"], "grpc")
    assert not _allowed(policies, client, pods["nn-worker"], 29500)


@pytest.fixture(scope="module", params=["inference-service.yaml", "triton.yaml"])
def kserve(request) -> dict[str, dict]:
    """The KServe examples: the built-in server's, and Triton's (`serve inference --engine triton`)."""
    docs = [d for d in yaml.safe_load_all((K8S / "kserve" / request.param).read_text()) if d]
    return {d["kind"]: d for d in docs}


def test_kserve_example_structure(kserve, base):
    """No schema is bundled for KServe's CRDs: check the fields KServe reads, by hand."""
    assert sorted(kserve) == ["InferenceService", "ServingRuntime"]
    runtime, isvc = kserve["ServingRuntime"], kserve["InferenceService"]
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    assert set(runtime) == {"apiVersion", "kind", "metadata", "spec"} == set(isvc)
    assert set(runtime["spec"]) <= {"supportedModelFormats", "protocolVersions", "containers", "volumes"}
    assert "v2" in runtime["spec"]["protocolVersions"]
    [container] = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container"  # the container KServe routes to and mounts /mnt/models in
    args = container["args"]
    engine = ["--engine", "triton"] if "--engine" in args else []
    assert args[:4 + len(engine)] == ["serve", "inference", *engine, "--bundle", "/mnt/models"]
    settings = settings_of(args)
    assert settings["host"] == "0.0.0.0" and settings["model_name"] == "{{.Name}}"
    assert [p["containerPort"] for p in container["ports"]] == [int(settings["http_port"])] == [8080]
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8080}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": 8080}
    sc = container["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}

    predictor = isvc["spec"]["predictor"]
    assert set(isvc["spec"]) == {"predictor"} and set(predictor) <= {"model", "minReplicas", "maxReplicas"}
    model = predictor["model"]
    assert set(model) == {"modelFormat", "runtime", "protocolVersion", "storageUri"}
    assert model["protocolVersion"] == "v2" and model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"] in [{k: f[k] for k in ("name", "version")}
                                    for f in runtime["spec"]["supportedModelFormats"]]
    pvc = one(base, "PersistentVolumeClaim", "hybridrec-state")["metadata"]["name"]
    assert model["storageUri"] == f"pvc://{pvc}/models/bundle"  # where deploy/k8s/serving's export Job writes


def test_kserve_runtime_container_validates_as_a_pods(kserve):
    import kubernetes_validate

    spec = kserve["ServingRuntime"]["spec"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hybridrec-predictor"},
           "spec": {"containers": spec["containers"], "volumes": spec["volumes"]}}
    kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)
