"""The Kubernetes manifests (deploy/k8s) render and are valid, offline.

Renders the kustomize base and the GPU overlay with `kubectl kustomize`,
validates every object against the Kubernetes JSON schemas bundled with the
`kubernetes-validate` package (strict: unknown fields are errors), and checks
the facts the deployment relies on: probes, the in-memory shm volume of the
PS, replica counts that agree with the config's cluster section, a hybridrec
config that loads, and what the GPU overlay adds. Needs kubectl, no cluster
and no Docker.
"""
from __future__ import annotations

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


@pytest.mark.parametrize("variant", ["base", "gpu"])
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
    from hybridrec.config import from_dict

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


def test_dataloader_is_a_job_with_a_stable_name(base):
    job = one(base, "Job", "dataloader")
    spec = pod_spec(job)
    cluster = hybridrec_config(base)["cluster"]
    assert cluster["dataloader"] == [f"{spec['hostname']}.{spec['subdomain']}:{GRPC_PORT}"]
    assert spec["restartPolicy"] in ("OnFailure", "Never")
    container = spec["containers"][0]
    assert container["args"][:2] == ["serve", "dataloader"]
    assert any("hybridrec data synth" in " ".join(c.get("args", [])) for c in spec["initContainers"])


def workloads(objects):
    return [o for o in objects if o["kind"] in ("StatefulSet", "Job")]


def test_grpc_probes(base):
    for obj in workloads(base):
        for c in pod_spec(obj)["containers"]:
            assert c["readinessProbe"]["grpc"]["port"] == GRPC_PORT, f"{obj['metadata']['name']}: readiness"
            if obj["kind"] == "StatefulSet":
                assert c["livenessProbe"]["grpc"]["port"] == GRPC_PORT, f"{obj['metadata']['name']}: liveness"
                assert c["startupProbe"]["grpc"]["port"] == GRPC_PORT, f"{obj['metadata']['name']}: startup"


def test_ps_shm_is_an_in_memory_empty_dir_at_the_configured_path(base):
    shm_dir = hybridrec_config(base)["ps"]["shm_dir"]
    spec = pod_spec(one(base, "StatefulSet", "ps"))
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


def test_hardening_and_resources(base):
    for obj in workloads(base):
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
