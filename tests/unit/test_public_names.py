"""The names users import stay what they were when the core moved into hybridrec/core/: `hybridrec.models` (the
model API, and what `model.path` names) and `hybridrec.config` are the core's own objects, every name of their
`__all__`, and a model class found through the old path builds."""
from __future__ import annotations

import hybridrec.config
import hybridrec.models
from hybridrec.core import config as core_config
from hybridrec.core.model import models as core_models


def test_the_model_api_is_the_cores_under_its_public_name():
    assert set(hybridrec.models.__all__) == set(core_models.__all__)
    assert {"FeatureInfo", "SeqEmbedding", "build_model", "DNN", "DLRM", "MMoE", "DIN"} <= set(core_models.__all__)
    for name in core_models.__all__:
        assert getattr(hybridrec.models, name) is getattr(core_models, name), name


def test_the_config_is_the_cores_under_its_public_name():
    assert set(hybridrec.config.__all__) == set(core_config.__all__)
    for name in core_config.__all__:
        assert getattr(hybridrec.config, name) is getattr(core_config, name), name
    assert hybridrec.config.ModelConfig().path == "hybridrec.models:DNN"  # what a config without one names


def test_a_model_named_by_its_public_path_builds():
    features = [hybridrec.models.FeatureInfo(name="f0", dim=4), hybridrec.models.FeatureInfo(name="f1", dim=4)]
    model = hybridrec.models.build_model("hybridrec.models:DNN", features, 3, {"hidden": [8]})
    assert isinstance(model, core_models.DNN)
