"""A local NATS broker for one `hybridrec run` whose `data.stream` names no url: `nats-server -js` on a free
loopback port, its store under the run directory, and the stream created, so that `hybridrec data replay
FILE --to nats://127.0.0.1:PORT/SUBJECT` can feed the run."""
from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from pathlib import Path

from hybridrec.core.runtime import log
from hybridrec.app.run.ports import free_port
from hybridrec.core.config import Config, ConfigError, StreamConfig

START_TIMEOUT_S = 20.0


class LocalBroker:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None

    def start(self, stream: StreamConfig, partitions: int = 1) -> str:
        """Start nats-server and create `stream.stream` holding `stream.subject` (its `partitions` partitions);
        returns its URL."""
        binary = shutil.which("nats-server")
        if binary is None:
            raise ConfigError("data.stream.url: unset, so hybridrec run starts a local nats-server, and none is "
                              "installed: install it (Debian package nats-server), or name a broker in "
                              "data.stream.url")
        port = free_port()
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        log_path = self.run_dir / "logs" / "nats-server.log"
        try:
            self.proc = spawn_nats_server(binary, port, self.run_dir / "nats", log_path)
        except RuntimeError:
            raise ConfigError(f"data.stream.url: the local nats-server did not start; see {log_path}") from None
        self.url = f"nats://127.0.0.1:{port}"
        asyncio.run(create_stream(self.url, stream, partitions))
        log.get().warning("local_broker", url=self.url, stream=stream.stream, subject=stream.subject,
                          feed=f"hybridrec data replay FILE --to {self.url}/{stream.subject}"
                               + (f" --partitions {partitions}" if partitions > 1 else ""))
        return self.url

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn_nats_server(binary: str, port: int, store: Path, log_path: Path) -> subprocess.Popen:
    """`nats-server -js` on 127.0.0.1:`port`, its store in `store`, its output appended to `log_path`; returns
    once it accepts connections (RuntimeError, the process stopped, if it does not within START_TIMEOUT_S)."""
    with open(log_path, "ab") as out:
        proc = subprocess.Popen([binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"nats-server did not start on port {port}; see {log_path}") from None
            time.sleep(0.05)


async def create_stream(url: str, stream: StreamConfig, partitions: int = 1) -> None:
    """Create `stream.stream` holding `stream.subject` (with several partitions, `<subject>.*`: one per data
    loader) on the broker at `url`."""
    import nats

    from hybridrec.app.data.replay import stream_subjects

    nc = await nats.connect(url, connect_timeout=5)
    try:
        await nc.jetstream().add_stream(name=stream.stream, subjects=stream_subjects(stream.subject, partitions))
    finally:
        await nc.close()


def with_url(config: Config, url: str) -> Config:
    """`config` with `data.stream.url` set."""
    stream = config.data.stream.model_copy(update={"url": url})
    return config.model_copy(update={"data": config.data.model_copy(update={"stream": stream})})
