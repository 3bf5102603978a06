"""hybridrec/app/plan/layout.py: the local layout fitted to the host's cores and GPUs, and what cannot fit."""
from __future__ import annotations

import pytest

from hybridrec.app.plan.layout import Host, fit
from hybridrec.core.config import ConfigError, from_dict
from hybridrec.core.runtime.service import ServiceHost


def _config(**cluster_and_training):
    training = {k: cluster_and_training.pop(k) for k in ("torch_threads", "backend") if k in cluster_and_training}
    return from_dict({"data": {"train": ["unused.tsv"]}, "cluster": cluster_and_training, "training": training})


def test_the_readme_layout_on_two_vcpus():
    config, layout = fit(_config(ps="auto", embedding_workers="auto", dataloader="auto",
                                 nn_workers=["127.0.0.1:0"] * 2, torch_threads="auto"), Host(cores=2, gpus=0))
    assert (len(config.cluster.ps), len(config.cluster.embedding_workers), len(config.cluster.dataloader),
            len(config.cluster.nn_workers), config.training.torch_threads) == (2, 1, 1, 2, 1)
    assert (layout.ps, layout.embedding_workers, layout.dataloader, layout.nn_workers) == (2, 1, 1, 2)
    assert "2 PS shards" in layout.line() and "on 2 cores and 0 GPU(s)" in layout.line()
    assert config.cluster.sized_by_host() == []


def test_a_gpu_host_gets_a_rank_per_gpu_and_the_rest_of_its_cores_for_the_sparse_side():
    config, layout = fit(_config(ps="auto", embedding_workers="auto", dataloader="auto", nn_workers="auto",
                                 torch_threads="auto"), Host(cores=16, gpus=1))
    assert layout.nn_workers == 1 and layout.torch_threads == 1
    assert (layout.ps, layout.embedding_workers, layout.dataloader) == (5, 4, 3)  # 14 cores: 0.42/0.31/0.27
    _, capped = fit(_config(dataloader="auto", nn_workers="auto"), Host(cores=16, gpus=1), max_loaders=2)
    assert capped.dataloader == 2
    assert len(config.cluster.ps) == 5 and len(config.cluster.nn_workers) == 1


def test_a_cpu_host_gives_the_dense_side_about_half_its_cores():
    _, layout = fit(_config(nn_workers="auto", torch_threads="auto"), Host(cores=16, gpus=0))
    assert layout.nn_workers == 1 and layout.torch_threads == 7
    assert layout.ps == 2 and layout.embedding_workers == 1  # listed (the defaults): kept as they are
    assert layout.fitted == ("cluster.nn_workers=1", "training.torch_threads=7")


def test_what_the_host_cannot_hold_is_refused_naming_the_key_or_adjusted_with_a_note():
    with pytest.raises(ConfigError, match="cluster.nn_workers: 2 NN workers on NCCL need a GPU each"):
        fit(_config(nn_workers=["127.0.0.1:0"] * 2), Host(cores=16, gpus=1))
    with pytest.raises(ConfigError, match="training.backend is nccl but this host has no GPU"):
        fit(_config(backend="nccl"), Host(cores=16, gpus=0))
    config, layout = fit(_config(nn_workers=["127.0.0.1:0"] * 2, torch_threads=8), Host(cores=4, gpus=0))
    assert config.training.torch_threads == 1 and "torch_threads 8 x 2 NN workers" in layout.notes[0]


def test_a_stream_gets_one_loader_whatever_the_host():
    config = from_dict({"data": {"stream": {"url": "nats://127.0.0.1:4222"}}, "cluster": {"dataloader": "auto"}})
    assert fit(config, Host(cores=64, gpus=0))[1].dataloader == 1


def test_a_service_started_alone_refuses_an_auto_list_naming_it():
    with pytest.raises(ConfigError, match="cluster.ps: auto is sized by `hybridrec run`"):
        ServiceHost("embedding_ps", _config(ps="auto"), 0)
