"""A stock tritonclient asking a Triton server over gRPC: run as a script, in its own process.

tritonclient.grpc's generated code declares the protobuf package `inference`,
as hybridrec/core/wire/proto/grpc_predict_v2_pb2.py does; one process cannot load both,
so tests/integration/test_triton.py runs this script as a subprocess.

    python triton_grpc_client.py REQUEST.npz GRPC_URL MODEL OUTPUT[,OUTPUT...]  ->  JSON on stdout

REQUEST.npz holds one array per input (text arrays are sent as BYTES). The
JSON is {"version", "outputs": {name: nested lists}} or, for a refused
request, {"status", "message"}.
"""
from __future__ import annotations

import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64", np.dtype(np.uint64): "UINT64"}


def main() -> None:
    request, url, model, outputs = sys.argv[1:5]
    client = grpcclient.InferenceServerClient(url=url)
    tensors = []
    with np.load(request) as data:
        for name in data.files:
            array = data[name]
            if array.dtype.kind == "U":
                array = np.vectorize(str.encode, otypes=[np.object_])(array)
            tensor = grpcclient.InferInput(name, list(array.shape), DATATYPES.get(array.dtype, "BYTES"))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
    try:
        result = client.infer(model, tensors,
                              outputs=[grpcclient.InferRequestedOutput(o) for o in outputs.split(",")])
    except InferenceServerException as exc:
        print(json.dumps({"status": exc.status(), "message": exc.message()}))
        return
    print(json.dumps({"version": result.get_response().model_version,
                      "outputs": {o: result.as_numpy(o).tolist() for o in outputs.split(",")}}))


if __name__ == "__main__":
    main()
