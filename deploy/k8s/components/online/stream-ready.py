"""Wait until the NATS broker of the job config's data.stream answers, and make sure its stream is there:
created, holding data.stream.subject (a partition <subject>.<l> per data loader l of cluster.dataloader), when it
is not (as `hybridrec data replay --partitions L` creates it; an existing one is left as it is). The data loader refuses to start on a stream that does not exist, and the pod that
creates it first (the loader's or the replay's init container) cannot be known in advance."""
import asyncio
import sys
import time

import nats

from hybridrec.app.data.replay import stream_subjects
from hybridrec.core.config import load_config

WAIT_S = 600
config = load_config("/etc/hybridrec/config.yaml")
stream, loaders = config.data.stream, len(config.cluster.dataloader)
if stream is None or stream.url is None:
    sys.exit("the job config names no broker: data.stream.url is not set")


async def quiet(exc):  # nats-py prints every failed connection attempt otherwise
    pass


async def ensure() -> None:
    nc = await nats.connect(stream.url, connect_timeout=3, allow_reconnect=False, max_reconnect_attempts=1,
                            reconnect_time_wait=1, error_cb=quiet)
    try:
        await nc.jetstream().add_stream(name=stream.stream, subjects=stream_subjects(stream.subject, loaders))
    finally:
        await nc.close()


deadline = time.monotonic() + WAIT_S
while True:
    try:
        asyncio.run(ensure())
        break
    except Exception as exc:  # noqa: BLE001 - not up yet (DNS, refused, JetStream starting): try again
        if time.monotonic() > deadline:
            sys.exit(f"{stream.url}: no NATS JetStream answered within {WAIT_S} s ({type(exc).__name__}: {exc})")
        print(f"waiting for {stream.url}: {type(exc).__name__}: {exc}", flush=True)
        time.sleep(5)
print(f"stream {stream.stream} holding {stream_subjects(stream.subject, loaders)} is on {stream.url}", flush=True)
