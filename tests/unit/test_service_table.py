"""The one table of service kinds (hybridrec/service.py) and the launcher's role lists derived from it."""
from __future__ import annotations

from pathlib import Path

from hybridrec import launcher
from hybridrec.config import ClusterConfig
from hybridrec.proto import pb
from hybridrec.service import SERVICE_KINDS, SERVICES

REPO = Path(__file__).resolve().parents[2]


def test_every_kind_names_a_cluster_key_a_proto_service_and_a_package():
    assert list(SERVICES) == [kind.name for kind in SERVICE_KINDS]
    for kind in SERVICE_KINDS:
        assert kind.cluster_key in ClusterConfig.model_fields, kind
        assert kind.proto_service in pb.DESCRIPTOR.services_by_name, kind
        assert (REPO / "services" / kind.name / "server.py").is_file(), kind
        assert not (kind.restart_in_place and kind.restart_as_group), kind


def test_launcher_roles():
    assert launcher.START_ORDER == ("embedding_ps", "embedding_worker", "nn_worker", "dataloader")
    assert launcher.FINISHING == ("nn_worker", "dataloader")
    assert tuple(k.name for k in SERVICE_KINDS if k.restart_in_place) == ("embedding_ps", "embedding_worker")
    assert launcher.GROUP == ("nn_worker", "dataloader")
    assert launcher.RESUMES_FROM == {"nn_worker": "nn_worker", "dataloader": "nn_worker"}
