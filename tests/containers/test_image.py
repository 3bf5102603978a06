"""A fresh container of the image compiles no numba kernel: the image holds them compiled
(hybridrec/app/run/numba_seed.py), each container copies them into its own cache directory as its command starts,
and every service's warm-up then loads them (numba writes nothing new into the cache)."""
from __future__ import annotations

import json

_SCRIPT = """
import json, os, tempfile, time
from pathlib import Path
from hybridrec.app.run.numba_seed import compile_all, seed

cache = Path(os.environ["NUMBA_CACHE_DIR"])
assert not cache.exists(), "a fresh container has no numba cache yet"
seeded = seed()
def files():
    return sorted((str(p.relative_to(cache)), p.stat().st_size) for p in cache.rglob("*") if p.is_file())
before = files()
started = time.perf_counter()
with tempfile.TemporaryDirectory() as scratch:
    compile_all(Path(scratch))
print(json.dumps({"seeded": seeded, "kernels": len(before), "written": [f for f in files() if f not in before],
                  "seconds": round(time.perf_counter() - started, 2)}))
"""


def test_a_fresh_read_only_container_loads_every_kernel_the_image_compiled(docker_client, image):
    output = docker_client.containers.run(image, ["-c", _SCRIPT], entrypoint="python", read_only=True,
                                          tmpfs={"/tmp": ""}, cap_drop=["ALL"], remove=True, stderr=True)
    result = json.loads(output.decode().strip().splitlines()[-1])
    assert result["seeded"] and result["kernels"] >= 10, result
    assert result["written"] == [], f"kernels compiled in the container, not loaded from the image: {result}"
    print(f"image kernels: {result['kernels']} cache files, every warm-up {result['seconds']} s, none compiled")
