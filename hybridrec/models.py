"""The model API under the name users import and configs name (`model.path: hybridrec.models:DNN`): the names
of `hybridrec.core.model.models.__all__` (`FeatureInfo`, `SeqEmbedding`, `build_model`, the example models),
defined there. The project's own code imports the core module; this name is for users' models and configs,
and for bundles written before the core had its own folder."""
from hybridrec.core.model.models import *  # noqa: F401,F403
from hybridrec.core.model.models import __all__  # noqa: F401
