"""The job config under the name users import (`from hybridrec.config import Config, load_config`): the names of
`hybridrec.core.config.__all__`, defined in the core's config package (a module per section). The project's own
code imports the core package."""
from hybridrec.core.config import *  # noqa: F401,F403
from hybridrec.core.config import __all__  # noqa: F401
