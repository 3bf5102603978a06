"""Config validation names the bad key; --set overrides any key."""
import inspect

import pytest
from pydantic import BaseModel

from hybridrec.core import config as config_module
from hybridrec.core.config import ConfigError, EmbeddingOptimizer, from_dict, load_config


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


@pytest.mark.parametrize("override, key", [
    ("optimizer.embedding.lr_power=0.5", "optimizer.embedding.lr_power"),
    ("optimizer.embedding.l1=-1", "optimizer.embedding.l1"),
    ("optimizer.embedding.l2=-0.1", "optimizer.embedding.l2"),
    ("data.source=criteo", "data.source: unknown key"),
])
def test_ftrl_keys_are_validated_and_data_source_is_gone(tmp_path, override, key):
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, BASE), [override])
    assert key in str(info.value)


def test_ftrl_keys_load():
    config = from_dict({"data": {"train": ["a.tsv"]},
                        "optimizer": {"embedding": {"name": "ftrl", "l1": 0.5, "l2": 0.25, "lr_power": -1}}})
    opt = config.optimizer.embedding
    assert (opt.name, opt.l1, opt.l2, opt.lr_power) == (EmbeddingOptimizer.FTRL, 0.5, 0.25, -1.0)
    assert f"{opt.name}" == "ftrl"


def _config_models() -> list[type[BaseModel]]:
    return [obj for obj in vars(config_module).values()
            if inspect.isclass(obj) and issubclass(obj, BaseModel) and obj.__module__.startswith(config_module.__name__)]


def test_every_config_field_has_a_docstring():
    """The pydantic models are the one spec of the config: every key says what it does, right under it."""
    models = _config_models()
    assert len(models) > 10 and config_module.Config in models
    missing = [f"{model.__name__}.{name}" for model in models for name, field in model.model_fields.items()
               if not (field.description or "").strip()]
    assert not missing, f"config fields without a docstring: {', '.join(missing)}"


def test_control_identities_need_tls():
    from hybridrec.core.config import ConfigError, from_dict

    tree = {"data": {"train": ["x"]}, "cluster": {"control_identities": ["nn-worker"]}}
    with pytest.raises(ConfigError, match="cluster.control_identities"):
        from_dict(tree)


def test_checkpoint_names_resolve_inside_the_root(tmp_path):
    from hybridrec.core.layouts.checkpoints import check_root, resolve_under

    root = tmp_path / "root"
    check_root(root)
    assert resolve_under(root, "step-00000001") == (root / "step-00000001").resolve()
    (tmp_path / "elsewhere").mkdir()
    (root / "link").symlink_to(tmp_path / "elsewhere")
    for bad in ("", "/etc", "../x", "a/../../x", "link", "link/y"):
        with pytest.raises(PermissionError):
            resolve_under(root, bad)
    with pytest.raises(PermissionError, match="no checkpoint root"):
        resolve_under(None, "step-00000001")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="checkpoint.dir"):
        check_root(tmp_path / "file" / "sub")


@pytest.mark.parametrize("stream, key, says", [
    ({"url": "http://broker:4222"}, "data.stream.url", "is not a NATS URL"),
    ({"url": "nats://broker"}, "data.stream.url", "is not a NATS URL"),
    ({"url": "nats://broker:99999"}, "data.stream.url", "is not a NATS URL"),
    ({"subject": "events.>"}, "data.stream.subject", "no wildcards"),
    ({"subject": "events..clicks"}, "data.stream.subject", "dot-separated tokens"),
    ({"fetch": 0}, "data.stream.fetch", "greater than 0"),
])
def test_a_stream_config_that_cannot_work_is_refused_naming_the_key(stream, key, says):
    tree = {"data": {"stream": stream, "eval": []}, "model": {"path": "hybridrec.models:DNN"}}
    with pytest.raises(ConfigError) as info:
        from_dict(tree)
    assert key in str(info.value) and says in str(info.value), str(info.value)
