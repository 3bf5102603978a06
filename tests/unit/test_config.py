"""Config validation names the bad key; --set overrides any key."""
import pytest

from hybridrec.config import ConfigError, load_config


def _write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


BASE = "data:\n  train: [a.tsv]\n"


def test_defaults_and_override(tmp_path):
    config = load_config(_write(tmp_path, BASE), ["training.epochs=3", "ps.capacity=10", "training.mode=sync"])
    assert config.training.epochs == 3 and config.ps.capacity == 10 and config.training.mode.value == "sync"
    assert len(config.features) == 26 and config.dims == [16]


@pytest.mark.parametrize("text, overrides, key", [
    ("", [], "data: required key is missing"),
    (BASE + "training:\n  batch_size: many\n", [], "training.batch_size"),
    (BASE, ["training.batch_size=70000"], "training.batch_size"),
    (BASE, ["training.mode=fast"], "training.mode"),
    (BASE, ["training.precision=fp16"], "training.precision"),
    (BASE + "trainig: {}\n", [], "trainig: unknown key"),
    (BASE, ["cluster.ps=[nohost]"], "cluster.ps"),
    (BASE, ["optimizer.embedding.name=rmsprop"], "optimizer.embedding.name"),
    (BASE + "features:\n  - {name: C1, group: 300}\n", [], "features.0.group"),
])
def test_errors_name_the_key(tmp_path, text, overrides, key):
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text), overrides)
    assert key in str(info.value)


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(_write(tmp_path, BASE), ["training.epochs"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "data: [unclosed"))
