"""`hybridrec run` from a loaded config to its summary: the config fitted to this host and checked (preflight),
the services' pre-imported parents started (forkserver.py) while the first rows are read, the notes on the
data passed to the caller, then the launcher runs the job with the progress line on.

Refusals are what preflight and the launcher raise: ConfigError (the user's config or files, exit 2) as it is,
the launcher's LaunchError (a run that failed, exit 1) as `RunFailed`; a Ctrl-C while the job runs is
`Interrupted` once every service has stopped. The CLI turns each into its message and exit code."""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable, Optional

from hybridrec.core.config import Config, ConfigError
from hybridrec.core.layouts.summary import RunSummary
from hybridrec.app.run.preflight import check_rows, data_notes, fit_to_host, preflight


class Interrupted(Exception):
    """Ctrl-C while the job ran: every service was stopped."""


class RunFailed(Exception):
    """The launcher's LaunchError (a service failed, the job did not finish), raised without importing the
    launcher where it is caught: the launcher's imports run beside the fork servers' start-up, not before."""


def run_job(config: Config, run_dir: Optional[Path], note: Callable[[str], None]) -> RunSummary:
    """Check, start and run the job in `run_dir` (default runs/<time>); `note` is called with each note on the
    data (read as configured but likely not as meant) before any service starts."""
    from hybridrec.app.run.forkserver import ForkServers

    run_dir = run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    # The services' parents start importing now, beside the rest of the launcher's own imports and set-up
    # (hybridrec/app/run/forkserver.py), and beside the checks, which end before any service starts: the
    # layout's (it imports numba, 0.2 s) and the first rows'. On the critical path of a warm start.
    fresh = not run_dir.exists()
    forkserver = ForkServers(run_dir / "logs")
    forkserver.start()
    try:
        config, layout = fit_to_host(config)
        preflight(config, model=False, rows=False)
        check_rows(config)
    except ConfigError:
        forkserver.close()
        if fresh:  # a refused config leaves no run directory behind, only its error
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    for text in data_notes(config):
        note(text)
    return _launch(config, run_dir, layout, forkserver)


def _launch(config: Config, run_dir: Path, layout, forkserver) -> RunSummary:
    """The launcher's log set up with the layout, then the job run with the progress line on."""
    from hybridrec.core.runtime import log
    from hybridrec.app.run import launcher
    from hybridrec.app.run.progress import Progress

    log.setup(service="launcher")
    log.get().info("layout", layout=layout.line())
    for adjusted in layout.notes:
        log.get().warning("layout_adjusted", note=adjusted)
    progress = Progress(config)
    try:
        # The model check imports torch (seconds of CPU): `hybridrec check --only model` forked from the
        # services' pre-imported parent, beside their start-up; a bad model stops the run with exit 2.
        return launcher.run_local(config, run_dir, progress=progress, check_model=True, forkserver=forkserver,
                                  layout=layout)
    except launcher.LaunchError as exc:
        raise RunFailed(str(exc)) from None
    except KeyboardInterrupt:
        raise Interrupted() from None
    finally:
        progress.close()
