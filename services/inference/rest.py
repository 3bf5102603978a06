"""The Open Inference Protocol's REST form (aiohttp), on the same event loop as the gRPC server.

    GET  /v2/health/live | /v2/health/ready | /v2
    GET  /v2/models/{name}[/versions/{v}] | .../ready
    POST /v2/models/{name}[/versions/{v}]/infer
    GET  /metrics                                     Prometheus

Request and response bodies are JSON as the specification has them; Triton's
binary tensor extension (a JSON header of `Inference-Header-Content-Length`
bytes followed by raw tensors, `binary_data_size` per input, `binary_data`
per requested output) is understood too, so stock clients work with their
defaults. Errors answer {"error": reason} with 400 (bad input) or 404
(unknown model or version).
"""
from __future__ import annotations

import asyncio
import json
import ssl
from typing import Any

import numpy as np
import prometheus_client
from aiohttp import web

from hybridrec.core.runtime import log
from services.inference.core import DECODE_ON_LOOP_BYTES, InferenceCore
from services.inference.byte_elements import ByteElements
from services.inference.grpc_api import checked_shape, split_bytes
from services.inference.inputs import DTYPES, BadInput, NotFound, NotReady, Tensor

HEADER_LENGTH = "Inference-Header-Content-Length"
MAX_BODY_BYTES = 256 << 20
"""`make_app`'s default body limit; `hybridrec serve inference` passes its `max_request_bytes`."""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _shape(value: Any, name: str) -> tuple[int, ...]:
    """JSON is untyped: the shape must be a list of non-negative integers before the shared bounds apply."""
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in value):
        raise BadInput(f"input {name!r}: shape must be a list of non-negative integers, got {value!r}")
    return checked_shape(value, f"input {name!r}: ")


def _flatten(data: Any) -> list:
    out: list = []
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        else:
            out.append(item)
    return out


def tensors_of(body: dict[str, Any], binary: bytes) -> tuple[list[Tensor], list[dict]]:
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BadInput("the request needs a non-empty list 'inputs'")
    tensors, offset = [], 0
    for i, inp in enumerate(inputs):
        if not isinstance(inp, dict) or not isinstance(inp.get("name"), str) or not isinstance(inp.get("datatype"),
                                                                                              str):
            raise BadInput(f"inputs[{i}] needs a string 'name' and 'datatype'")
        name, datatype = inp["name"], inp["datatype"]
        shape = _shape(inp.get("shape"), name)
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        params = inp.get("parameters") or {}
        size = params.get("binary_data_size") if isinstance(params, dict) else None
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise BadInput(f"input {name!r}: binary_data_size {size!r} does not fit the {len(binary)} binary "
                               "bytes after the JSON header")
            raw, offset = binary[offset:offset + size], offset + size
            if datatype == "BYTES":
                data: Any = split_bytes(raw, name)
            elif datatype in DTYPES:
                dtype = np.dtype(DTYPES[datatype]).newbyteorder("<")
                if len(raw) != count * dtype.itemsize:
                    raise BadInput(f"input {name!r}: shape {list(shape)} of {datatype} needs "
                                   f"{count * dtype.itemsize} bytes, got {len(raw)}")
                data = np.frombuffer(raw, dtype)
            else:
                raise BadInput(f"input {name!r}: unknown datatype {datatype!r}")
        else:
            if "data" not in inp:
                raise BadInput(f"input {name!r} has no 'data'")
            values = _flatten(inp["data"])
            if datatype == "BYTES":
                if not all(isinstance(v, str) for v in values):
                    raise BadInput(f"input {name!r}: BYTES data must be strings")
                data = ByteElements.of([v.encode("utf-8", "surrogatepass") for v in values])
            elif datatype in DTYPES:
                kind = np.dtype(DTYPES[datatype]).kind
                ok = (all(isinstance(v, bool) for v in values) if kind == "b" else
                      all(isinstance(v, int) and not isinstance(v, bool) for v in values) if kind in "iu" else
                      all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values))
                if not ok:
                    raise BadInput(f"input {name!r}: data must be {datatype} values")
                try:
                    data = np.array(values, dtype=DTYPES[datatype])
                except OverflowError:
                    raise BadInput(f"input {name!r}: a value is out of range for {datatype}") from None
            else:
                raise BadInput(f"input {name!r}: unknown datatype {datatype!r}")
        if len(data) != count:
            raise BadInput(f"input {name!r}: shape {list(shape)} needs {count} elements, got {len(data)}")
        tensors.append(Tensor(name, datatype, shape, data))
    if offset != len(binary):
        raise BadInput(f"{len(binary) - offset} binary bytes after the JSON header belong to no input")
    outputs = body.get("outputs") or []
    if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                for o in outputs):
        raise BadInput("'outputs' must be a list of objects with a 'name'")
    return tensors, outputs


def parse_request(raw: bytes, header_len: str | None) -> tuple[dict[str, Any], list[Tensor], list[dict]]:
    """An infer request's body (JSON, or Triton's binary extension: `header_len` bytes of JSON, then the
    tensors' bytes) as (its JSON object, its input tensors, the outputs it asks for); BadInput for anything
    else, whatever Python's JSON parser raises (nesting thousands deep, an integer of thousands of digits)."""
    if header_len is not None:
        if not header_len.isdigit() or int(header_len) > len(raw):
            raise BadInput(f"{HEADER_LENGTH}: {header_len!r} does not fit a body of {len(raw)} bytes")
        head, binary = raw[:int(header_len)], raw[int(header_len):]
    else:
        head, binary = raw, b""
    try:
        body = json.loads(head)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, int digits, depth
        raise BadInput(f"the request body is not JSON Python can read: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise BadInput("the request body must be a JSON object")
    tensors, outputs = tensors_of(body, binary)
    return body, tensors, outputs


def ssl_context(tls) -> ssl.SSLContext:
    """The REST endpoint's TLS (tls: inference_config.ServingTLSConfig): HTTPS with `cert`; with
    `require_client_cert`, a client certificate signed by `ca` is required, as on the gRPC endpoint."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert, tls.key)
    if tls.require_client_cert:
        context.load_verify_locations(tls.ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def make_app(core: InferenceCore, *, max_body_bytes: int = MAX_BODY_BYTES, max_concurrent: int | None = None,
             read_timeout_s: float | None = None) -> web.Application:
    """The REST endpoints. A body past `max_body_bytes` is answered 413 before it is read; past
    `max_concurrent` infer requests at once, another is answered 429 with a Retry-After header, at once; a
    body that has not arrived within `read_timeout_s` of its headers is answered 408. A body larger than
    `DECODE_ON_LOOP_BYTES` is parsed on a thread, so that the loop goes on answering other requests."""
    busy = [0]
    logger = log.get()

    def version_of(request: web.Request) -> str:
        return request.match_info.get("version", "")

    async def live(request: web.Request) -> web.Response:
        return web.json_response({"live": True})

    async def ready(request: web.Request) -> web.Response:
        return web.json_response({"ready": core.ready}, status=200 if core.ready else 503)

    async def server_metadata(request: web.Request) -> web.Response:
        return web.json_response(core.server_metadata())

    async def model_metadata(request: web.Request) -> web.Response:
        return web.json_response(core.model_metadata(request.match_info["name"], version_of(request)))

    async def model_ready(request: web.Request) -> web.Response:
        core.check_model(request.match_info["name"], version_of(request))  # 404 for an unknown model
        ok = core.model_ready(request.match_info["name"], version_of(request))
        return web.json_response({"name": core.model_name, "ready": ok}, status=200 if ok else 503)

    async def infer(request: web.Request) -> web.Response:
        if max_concurrent is not None and busy[0] >= max_concurrent:
            return web.json_response({"error": f"{busy[0]} requests in progress, the most this server takes at "
                                               f"once (max_concurrent_requests): try again shortly"},
                                     status=429, headers={"Retry-After": "1"})
        busy[0] += 1
        try:
            return await _infer(request)
        finally:
            busy[0] -= 1

    async def _infer(request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > max_body_bytes:
            # refused from its header, before a byte of it is read (aiohttp would read up to the limit first)
            raise web.HTTPRequestEntityTooLarge(max_size=max_body_bytes, actual_size=request.content_length)
        core.check_model(request.match_info["name"], version_of(request))  # 404 before any parsing
        try:
            raw = await asyncio.wait_for(request.read(), read_timeout_s)
        except asyncio.TimeoutError:
            raise web.HTTPRequestTimeout(text=json.dumps({"error": f"the body did not arrive within "
                                                                   f"{read_timeout_s} s (http_read_timeout_s)"}),
                                         content_type="application/json") from None
        if len(raw) > DECODE_ON_LOOP_BYTES:
            body, tensors, outputs = await asyncio.to_thread(parse_request, raw, request.headers.get(HEADER_LENGTH))
        else:
            body, tensors, outputs = parse_request(raw, request.headers.get(HEADER_LENGTH))
        answer = await core.infer(request.match_info["name"], version_of(request), tensors,
                                  [o["name"] for o in outputs])
        params = body.get("parameters") if isinstance(body.get("parameters"), dict) else {}
        want_binary = bool(params.get("binary_data_output")) or any(
            isinstance(o.get("parameters"), dict) and o["parameters"].get("binary_data") for o in outputs)
        values = {name: np.ascontiguousarray(v, np.float32) for name, v in answer.outputs.items()}
        outs: list[dict[str, Any]] = [{"name": name, "datatype": "FP32", "shape": list(v.shape)}
                                      for name, v in values.items()]
        reply: dict[str, Any] = {"model_name": answer.model_name, "model_version": answer.model_version,
                                 "parameters": answer.parameters, "outputs": outs}
        if isinstance(body.get("id"), str):
            reply["id"] = body["id"]
        if not want_binary:
            for out, v in zip(outs, values.values()):
                out["data"] = v.reshape(-1).tolist()
            return web.json_response(reply)
        for out, v in zip(outs, values.values()):
            out["parameters"] = {"binary_data_size": v.nbytes}
        head_bytes = json.dumps(reply).encode()
        return web.Response(body=head_bytes + b"".join(v.tobytes() for v in values.values()),
                            content_type="application/octet-stream", headers={HEADER_LENGTH: str(len(head_bytes))})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=prometheus_client.generate_latest(),
                            headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})

    @web.middleware
    async def errors(request: web.Request, handler):
        try:
            return await handler(request)
        except BadInput as exc:
            return _error(400, str(exc))
        except NotFound as exc:
            return _error(404, str(exc))
        except NotReady as exc:
            return _error(503, str(exc))
        except web.HTTPException:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug must not kill the server; logged with its trace
            logger.exception("rest_failed", path=request.path)
            return _error(500, f"{type(exc).__name__}: {exc}")

    app = web.Application(middlewares=[errors], client_max_size=max_body_bytes)
    base = "/v2/models/{name}"
    app.add_routes([
        web.get("/v2/health/live", live),
        web.get("/v2/health/ready", ready),
        web.get("/v2", server_metadata),
        web.get(base, model_metadata),
        web.get(base + "/versions/{version}", model_metadata),
        web.get(base + "/ready", model_ready),
        web.get(base + "/versions/{version}/ready", model_ready),
        web.post(base + "/infer", infer),
        web.post(base + "/versions/{version}/infer", infer),
        web.get("/metrics", metrics),
    ])
    return app
