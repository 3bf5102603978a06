"""A stock OIP client (tritonclient) asking the inference service: run as a script, in its own process.

tritonclient's generated code declares the protobuf package `inference`, as
hybridrec/core/wire/proto/grpc_predict_v2_pb2.py does; one process cannot load both, so
the tests run this script as a subprocess.

    python oip_client.py REQUEST.npz GRPC_URL HTTP_URL MODEL  ->  JSON on stdout
"""
from __future__ import annotations

import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def main() -> None:
    request, grpc_url, http_url, model = sys.argv[1:5]
    data = np.load(request)
    out: dict = {}
    for kind, module, url in (("grpc", grpcclient, grpc_url), ("http", httpclient, http_url)):
        client = module.InferenceServerClient(url=url)
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(model)
        meta = client.get_model_metadata(model)
        versions = meta.versions if kind == "grpc" else meta["versions"]
        for inputs in (("ids", "dense"), ("rows",)):
            tensors = []
            for name in inputs:
                array = data[name]
                if name == "rows":
                    array = np.array([s.encode() for s in array], dtype=np.object_)
                dtype = {"ids": "UINT64", "dense": "FP32", "rows": "BYTES"}[name]
                t = module.InferInput(name, list(array.shape), dtype)
                t.set_data_from_numpy(array)
                tensors.append(t)
            for binary in ((False, True) if kind == "http" else (True,)):
                if kind == "http":
                    outputs = [httpclient.InferRequestedOutput("probability", binary_data=binary)]
                    for t, name in zip(tensors, inputs):  # JSON or binary tensors in the request too
                        array = data[name] if name != "rows" else np.array([s.encode() for s in data[name]],
                                                                          dtype=np.object_)
                        t.set_data_from_numpy(array, binary_data=binary)
                else:
                    outputs = [grpcclient.InferRequestedOutput("probability")]
                result = client.infer(model, tensors, outputs=outputs)
                response = result.get_response()
                version = response.model_version if kind == "grpc" else response["model_version"]
                out[f"{kind}/{'+'.join(inputs)}/{'binary' if binary else 'json'}"] = {
                    "probability": result.as_numpy("probability").tolist(), "version": version,
                    "versions": list(versions)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
