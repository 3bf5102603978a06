"""The testbed spec is validated before anything is created (benchmarks/testbed/spec.py)."""
from __future__ import annotations

import os

import pytest

from benchmarks.testbed.spec import SpecError, format_rate, load_spec, parse_rate, split_cpus, two_hosts

REPLICAS = {"embedding_ps": 2, "embedding_worker": 1, "nn_worker": 2, "dataloader": 1}


def test_rates_parse() -> None:
    assert parse_rate("4gbit") == 4e9
    assert parse_rate("250mbit") == 250e6
    assert parse_rate("0.5Gbit") == 5e8
    assert parse_rate(1e9) == 1e9
    assert parse_rate("unshaped") is None and parse_rate(None) is None
    assert format_rate(2.5e8) == "250mbit" and format_rate(None) == "unshaped"


@pytest.mark.parametrize("rate", [0, -1, "0gbit", "-5mbit", "fast", "10 parsecs", "1e3", True])
def test_impossible_rates_are_refused(rate) -> None:
    with pytest.raises(SpecError, match=r"hosts\.0\.link\.up"):
        load_spec({"hosts": [{"name": "a", "services": ["nn_worker"], "link": {"up": rate}}]})


def test_unknown_service_is_refused() -> None:
    with pytest.raises(SpecError, match="unknown service 'parameter_server'"):
        load_spec({"hosts": [{"name": "a", "services": ["parameter_server"]}]})


def test_host_without_services_is_refused() -> None:
    with pytest.raises(SpecError, match=r"hosts\.1\.services"):
        load_spec({"hosts": [{"name": "a", "services": ["nn_worker"]}, {"name": "b", "services": []}]})


def test_bad_host_names_and_duplicates() -> None:
    with pytest.raises(SpecError, match="host name"):
        load_spec({"hosts": [{"name": "Trainer-Host-1", "services": ["nn_worker"]}]})
    with pytest.raises(SpecError, match="unique"):
        load_spec({"hosts": [{"name": "a", "services": ["nn_worker"]}, {"name": "a", "services": ["dataloader"]}]})


def test_every_replica_placed_exactly_once() -> None:
    spec = two_hosts("1gbit")
    where = spec.assign(REPLICAS)
    assert where[("embedding_ps", 1)] == "embedding" and where[("nn_worker", 0)] == "trainer"
    assert spec.address("trainer") != spec.address("embedding")
    twice = load_spec({"hosts": [{"name": "a", "services": ["nn_worker", "dataloader"]},
                                 {"name": "b", "services": ["embedding_ps", "embedding_worker", "nn_worker:1"]}]})
    with pytest.raises(SpecError, match="nn_worker:1 is placed on both a and b"):
        twice.assign(REPLICAS)
    missing = load_spec({"hosts": [{"name": "a", "services": ["nn_worker", "dataloader", "embedding_ps:0"]},
                                   {"name": "b", "services": ["embedding_worker"]}]})
    with pytest.raises(SpecError, match="not placed on any host: embedding_ps:1"):
        missing.assign(REPLICAS)
    with pytest.raises(SpecError, match="embedding_ps:5 does not exist"):
        load_spec({"hosts": [{"name": "a", "services": ["embedding_ps:5"]}]}).assign(REPLICAS)


def test_host_cpu_lists() -> None:
    usable = sorted(os.sched_getaffinity(0))
    spec = load_spec({"hosts": [{"name": "a", "services": ["nn_worker"], "cpus": f"{usable[0]}-{usable[-1]}"}]})
    assert spec.hosts[0].cpu_set() == set(usable)
    assert load_spec({"hosts": [{"name": "a", "services": ["nn_worker"]}]}).hosts[0].cpu_set() is None
    for bad, why in (("two", "expected a list"), ("3-1", "expected a list"), ("0,", "expected a list"),
                     (str(max(usable) + 64), "not available here")):
        with pytest.raises(SpecError, match=rf"hosts\.0\.cpus: cpus '{bad}': .*{why}"):
            load_spec({"hosts": [{"name": "a", "services": ["nn_worker"], "cpus": bad}]})


def test_split_cpus_gives_each_host_its_own() -> None:
    halves = split_cpus()
    if len(os.sched_getaffinity(0)) < 2:
        assert halves is None
        return
    spec = two_hosts("1gbit", cpus=halves)
    trainer, embedding = (h.cpu_set() for h in spec.hosts)
    assert trainer and embedding and not trainer & embedding
    assert trainer | embedding == os.sched_getaffinity(0) and len(trainer) >= len(embedding)


def test_the_data_loader_on_a_host_of_its_own() -> None:
    spec = two_hosts("50mbit", cpus=("0", "1") if len(os.sched_getaffinity(0)) >= 2 else None, loader_host=True)
    where = spec.assign(REPLICAS)
    assert where[("dataloader", 0)] == "data" and where[("nn_worker", 1)] == "trainer"
    data = next(h for h in spec.hosts if h.name == "data")
    embedding = next(h for h in spec.hosts if h.name == "embedding")
    assert data.cpu_set() == embedding.cpu_set()  # beside the embedding host, off the trainer's CPUs
    assert len({spec.address(h.name) for h in spec.hosts}) == 3


def test_fault_option_reads_each_kind_and_refuses_the_rest():
    from benchmarks.testbed.__main__ import parse_fault

    lost = parse_fault("psa:lost:5:3")
    assert (lost.host, lost.kind, lost.at_s, lost.duration_s) == ("psa", "lost", 5.0, 3.0)
    assert parse_fault("embedding:slow:5:20:4").factor == 4.0
    assert parse_fault("embedding:down:1:2").kind == "down"
    for bad in ("psa:lost:5:3:2", "psa:gone:5:3", "psa:lost:5"):
        with pytest.raises(ValueError, match="--fault"):
            parse_fault(bad)
