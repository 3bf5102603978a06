"""The one table of service kinds (hybridrec/core/runtime/service.py) and the launcher's role lists derived from it."""
from __future__ import annotations

from pathlib import Path

from hybridrec.app.run import launcher
from hybridrec.core.config import ClusterConfig
from hybridrec.core.wire.proto import pb
from hybridrec.core.runtime.service import SERVICE_KINDS, SERVICES

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


def test_one_serve_subcommand_per_service():
    """`hybridrec serve NAME` has one command per service kind the launcher starts, plus the inference
    service (started alone, with its own settings): each with its own options, no option of another role."""
    from typer.main import get_command

    from hybridrec.app.cli.serve import group as serve_app

    serve = get_command(serve_app)
    assert set(serve.commands) == set(SERVICES) | {"inference"}
    options = {name: {p.name for p in command.params} for name, command in serve.commands.items()}
    assert options["nn_worker"] == options["dataloader"] == options["embedding_worker"] == \
        {"config_path", "replica", "overrides"}
    assert {"bundle", "follow", "ps"} <= options["inference"] and "replica" not in options["inference"]
    assert {"bundle", "listen", "tls"} <= options["embedding_ps"] and "follow" not in options["embedding_ps"]
