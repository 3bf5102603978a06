"""`hybridrec serve inference --engine triton`: the bundle served by Triton's C++ front end.

The model repository is written beside the run (`triton_repository.write_repository`, the bundle linked,
not copied), a `tritonserver` is started on it with the built-in server's ports, and this process waits
until the model is ready, then until it is told to stop (SIGTERM, SIGINT), and stops Triton cleanly.

Which `tritonserver`: `--tritonserver PATH`, else one on PATH (a Triton container's), else the one inside the
`nvidia-pytriton` wheel (installed with `pip install --no-deps nvidia-pytriton`: its declared dependencies
would pin numpy below 2 for the rest of hybridrec, and its own Python API is not used). The wheel's server
gets a backend directory of its Python backend with the stub built for this interpreter's Python version,
and the wheel's libraries on LD_LIBRARY_PATH, as pytriton itself arranges them.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from hybridrec.core.runtime import log
from hybridrec.core.config import ConfigError
from hybridrec.core.config.inference import InferenceConfig
from hybridrec.core.layouts.versions import Follower, list_versions
from services.inference.triton_repository import add_followed_version, write_model, write_repository

READY_TIMEOUT_S = 300.0
EXIT_TIMEOUT_S = 5
BACKEND_SITE = Path(sys.prefix) / "triton-backend-site"
"""numpy below 2 for Triton's Python backend, put first on its path: the wheel's backend stub was built against
numpy 1, and under numpy 2 every tensor it hands over reads each element as the first (BYTES included). Made
with `pip install --target <this> "numpy<2"`; the rest of hybridrec keeps numpy 2 (packages built against
numpy 2 also run on numpy 1)."""


def backend_site(*, required: bool) -> list[str]:
    """[BACKEND_SITE] where it holds numpy, [] where this interpreter's numpy is below 2 or (not `required`)
    where it is missing; ConfigError naming the command that makes it otherwise."""
    import numpy

    if (BACKEND_SITE / "numpy").is_dir():
        return [str(BACKEND_SITE)]
    if int(numpy.__version__.split(".")[0]) < 2 or not required:
        return []
    raise ConfigError(f"--engine triton: Triton's Python backend needs numpy below 2 beside this numpy "
                      f"{numpy.__version__}: pip install --target {BACKEND_SITE} 'numpy<2'")


@dataclass(frozen=True)
class TritonInstall:
    """Where a `tritonserver` is and what it needs to run hybridrec's Python-backend model."""

    binary: Path
    backends: Path | None = None  # --backend-directory (None: the server's own default)
    caches: Path | None = None
    env: dict[str, str] = field(default_factory=dict)


def _wheel_root() -> Path | None:
    """The `pytriton` package directory of an installed nvidia-pytriton wheel (found without importing it)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def find_tritonserver(explicit: str | None, work: Path) -> TritonInstall:
    """The `tritonserver` to run (see the module docstring); ConfigError naming what was looked for."""
    # The backend stub embeds an interpreter: it finds hybridrec and its dependencies where this one does.
    site_env = {"HYBRIDREC_SITE": os.pathsep.join([*backend_site(required=False),
                                                   str(Path(__file__).resolve().parents[2]), *site.getsitepackages()])}
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ConfigError(f"--tritonserver {explicit}: not an executable file")
        return TritonInstall(path, env=site_env)
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(Path(on_path), env=site_env)
    root = _wheel_root()
    binary = root / "tritonserver" / "bin" / "tritonserver" if root else None
    if binary is None or not binary.is_file():
        raise ConfigError("--engine triton: no tritonserver: give --tritonserver PATH, put one on PATH (a Triton "
                          "container), or install the nvidia-pytriton wheel (pip install --no-deps nvidia-pytriton)")
    backend_site(required=True)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "tritonserver" / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ConfigError(f"--engine triton: the nvidia-pytriton wheel has no Python backend for Python {version} "
                          f"({stub})")
    backend = work / "backends" / "python"
    backend.mkdir(parents=True, exist_ok=True)
    for item in (root / "tritonserver" / "backends" / "python").iterdir():
        (backend / item.name).symlink_to(item)
    # The backend runs the stub found beside itself. A link, not a copy: the work directory may be on a
    # noexec mount (a container's /tmp tmpfs), while the link's target, in site-packages, may be executed.
    (backend / "triton_python_backend_stub").symlink_to(stub)
    libs = root.parent / "nvidia_pytriton.libs"
    env = dict(site_env)
    own = []
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        # The stub links libpython3.X: this interpreter's own (and its standard library), so that the
        # packages built for it load; without a shared build, the host's (Debian: libpython3.11).
        own = [sysconfig.get_config_var("LIBDIR")]
        env["PYTHONHOME"] = sys.base_prefix
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [*own, os.environ.get("LD_LIBRARY_PATH"), str(libs)]))
    return TritonInstall(binary, work / "backends", root / "tritonserver" / "caches", env)


def command(install: TritonInstall, repo: Path, settings: InferenceConfig) -> list[str]:
    """tritonserver's command line: the built-in server's host and ports, the repository; with `follow`, model
    control through the repository API (versions are loaded as they are published)."""
    args = [str(install.binary), f"--model-repository={repo}", f"--grpc-address={settings.host}",
            f"--grpc-port={settings.grpc_port}", "--exit-on-error=true", "--strict-readiness=true",
            # On SIGTERM, requests in flight get EXIT_TIMEOUT_S to finish; Triton's default (30 s) also waits
            # that long for every idle keep-alive connection a client left open.
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}"]
    if settings.follow is not None:
        args += ["--model-control-mode=explicit", f"--load-model={settings.model_name}"]
    if settings.http_port is None:
        args.append("--allow-http=false")
    else:
        args += [f"--http-address={settings.host}", f"--http-port={settings.http_port}"]
    if settings.metrics_port:
        args += [f"--metrics-address={settings.host}", f"--metrics-port={settings.metrics_port}"]
    else:
        args.append("--allow-metrics=false")
    if install.backends is not None:
        args.append(f"--backend-directory={install.backends}")
    if install.caches is not None:
        args.append(f"--cache-directory={install.caches}")
    return args


class TritonProcess:
    """A running `tritonserver` serving one hybridrec model; `stop()` ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, settings: InferenceConfig, *, tritonserver: str | None = None, work: Path | None = None,
                 log_path: Path | None = None, repository: Path | None = None):
        """`repository`: serve this one (`export --triton`'s) instead of writing one for `settings.bundle`."""
        if settings.follow is not None and settings.http_port is None:
            raise ConfigError("--engine triton --follow loads each version through Triton's REST repository API: "
                              "http_port may not be null")
        if settings.ps:
            raise ConfigError("--engine triton looks rows up in the bundle's own tables; --ps is not supported by it")
        if settings.tls is not None:
            raise ConfigError("--engine triton: tls is not supported by it (Triton's HTTP endpoint has no TLS); "
                              "serve with --engine builtin, or put a TLS-terminating proxy in front")
        if settings.grpc_port == 0 or settings.http_port == 0:
            raise ConfigError("--engine triton needs fixed ports: grpc_port and http_port may not be 0")
        self.settings = settings
        self.work = work or Path(tempfile.mkdtemp(prefix="hybridrec-triton-"))
        try:
            self.install = find_tritonserver(tritonserver, self.work)
            self.repo = repository or self.work / "models"
            self.served = 0  # with follow: the version Triton serves
            self.skipped: dict[int, str] = {}
            if settings.follow is not None:
                self._first_version()
            elif repository is None:
                write_repository(Path(settings.bundle), self.repo, settings, link=True)
        except BaseException:
            if work is None:
                shutil.rmtree(self.work, ignore_errors=True)
            raise
        self.log_path = log_path or self.work / "tritonserver.log"
        self.proc = subprocess.Popen(command(self.install, self.repo, settings), stdout=open(self.log_path, "ab"),
                                     stderr=subprocess.STDOUT, env={**os.environ, **self.install.env})

    # -- following a training job's versions -----------------------------------------------------
    def _first_version(self) -> None:
        """Wait (up to `follow_wait_s`) for a version that loads, as the built-in server's follower does, and
        write the model with it: its config from that version, the version for Triton to load first."""
        from services.inference.follow import inference_model
        from services.inference.model import build_dense

        s = self.settings
        follower = Follower(Path(s.follow), check=s.verify_bundle,
                            build=lambda snap: inference_model(snap, build_dense(snap.manifest, snap.dense_state),
                                                               compile=False))
        deadline = time.monotonic() + s.follow_wait_s
        while follower.poll() is None:
            if time.monotonic() > deadline:
                raise ConfigError(f"--follow {s.follow}: no complete version within follow_wait_s "
                                  f"({s.follow_wait_s:g} s)")
            time.sleep(s.follow_poll_s)
        self.skipped.update(follower.skipped)
        model_dir = write_model(self.repo, s, follower.built)
        add_followed_version(model_dir, Path(s.follow), follower.current.version)
        self.served = follower.current.version

    def poll_versions(self) -> int | None:
        """Load the newest complete version newer than the one served, if any: Triton loads it beside the
        served one and retires that once the new one is ready (its version policy keeps the latest), so no
        request fails during the swap. A version Triton cannot load is skipped for good, logged, and the
        served one stays. Returns the version swapped in, or None."""
        versions, _ = list_versions(Path(self.settings.follow))
        newer = [v.version for v in versions if v.version > self.served and v.version not in self.skipped]
        if not newer:
            return None
        target = max(newer)
        model_dir = self.repo / self.settings.model_name
        add_followed_version(model_dir, Path(self.settings.follow), target)
        error = self._load()
        if error is not None:
            self.skipped[target] = error
            shutil.rmtree(model_dir / str(target), ignore_errors=True)
            log.get().warning("version_skipped", version=target, reason=error)
            self._load()  # the served version again, should Triton have let it go
            return None
        for old in model_dir.iterdir():
            if old.is_dir() and old.name.isdigit() and int(old.name) < target:
                shutil.rmtree(old, ignore_errors=True)
        log.get().info("version_swapped", engine="triton", version=target, previous=self.served)
        self.served = target
        return target

    def _rest_url(self, path: str) -> str:
        """Triton's REST endpoint `/v2/<path>` as this process reaches it (loopback for a wildcard address)."""
        s = self.settings
        host = "127.0.0.1" if s.host in ("0.0.0.0", "") else s.host
        return f"http://{host}:{s.http_port}/v2/{path}"

    def _load(self) -> str | None:
        """Ask Triton to (re)load the model from its directory; None on success, else Triton's error."""
        request = urllib.request.Request(self._rest_url(f"repository/models/{self.settings.model_name}/load"),
                                         data=b"{}", method="POST", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=READY_TIMEOUT_S):
                return None
        except urllib.error.HTTPError as exc:
            return exc.read().decode(errors="replace") or str(exc)
        except (urllib.error.URLError, OSError) as exc:
            return str(exc)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until the model answers ready (over REST, or over gRPC without it); RuntimeError with Triton's log
        if the server exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"tritonserver did not get ready (exit {self.proc.returncode}); its log "
                                   f"{self.log_path}:\n{self.log_tail()}")
            time.sleep(0.1)

    def _ready(self) -> bool:
        s = self.settings
        if s.http_port is not None:
            try:
                with urllib.request.urlopen(self._rest_url(f"models/{s.model_name}/ready"), timeout=1.0) as reply:
                    return reply.status == 200
            except (urllib.error.URLError, OSError):
                return False
        import grpc

        from hybridrec.core.wire.proto import grpc_predict_v2_pb2 as oip
        with grpc.insecure_channel(f"{s.host}:{s.grpc_port}") as channel:
            ready = channel.unary_unary("/inference.GRPCInferenceService/ModelReady",
                                        request_serializer=lambda m: m.SerializeToString(),
                                        response_deserializer=oip.ModelReadyResponse.FromString)
            try:
                return ready(oip.ModelReadyRequest(name=s.model_name), timeout=1.0).ready
            except grpc.RpcError:
                return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def serve(settings: InferenceConfig, tritonserver: str | None = None) -> int:
    """Run Triton on the bundle until SIGTERM/SIGINT or until Triton exits; returns Triton's exit status."""
    logger = log.setup(service="inference")
    triton = TritonProcess(settings, tritonserver=tritonserver)
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    try:
        triton.wait_ready()
        logger.info("serving", engine="triton", model=settings.model_name, grpc_port=settings.grpc_port,
                    http_port=settings.http_port, tritonserver=str(triton.install.binary),
                    repository=str(triton.repo), log=str(triton.log_path))
        while not stopping and triton.proc.poll() is None:
            if settings.follow is not None:
                triton.poll_versions()
            time.sleep(settings.follow_poll_s if settings.follow is not None else 0.2)
        if triton.proc.poll() is not None:
            logger.error("tritonserver_exited", status=triton.proc.returncode, log=triton.log_tail())
    finally:
        status = triton.stop()
        shutil.rmtree(triton.work, ignore_errors=True)
    return 0 if stopping else (status or 1)
