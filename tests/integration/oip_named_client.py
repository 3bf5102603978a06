"""A stock OIP client (tritonclient) sending named feature tensors: run as a script, in its own process
(tritonclient's protobuf package clashes with hybridrec's in one process: see oip_client.py).

    python oip_named_client.py REQUESTS.npz GRPC_URL HTTP_URL MODEL OUT.npz

REQUESTS.npz holds `<request>/<input name>` arrays: bytes arrays (numpy 'S') are sent as BYTES, int64 as
INT64, float32 as FP32. Every output the model metadata lists is asked for by name; OUT.npz gets, per
protocol (`grpc`, `http`), every request's answers concatenated: `grpc` the probabilities, `grpc/NAME` any
other output (a multi-task model's tasks), and `grpc_outputs` the output names the metadata listed.
"""
from __future__ import annotations

import sys

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

DATATYPES = {"i": "INT64", "f": "FP32", "S": "BYTES"}


def main() -> None:
    path, grpc_url, http_url, model, out = sys.argv[1:6]
    data = np.load(path)
    requests: dict[int, list[str]] = {}
    for key in data.files:
        index, name = key.split("/", 1)
        requests.setdefault(int(index), []).append(name)
    answers: dict[str, list[np.ndarray]] = {}
    for kind, module, url in (("grpc", grpcclient, grpc_url), ("http", httpclient, http_url)):
        client = module.InferenceServerClient(url=url)
        meta = client.get_model_metadata(model)
        names = [o.name for o in meta.outputs] if kind == "grpc" else [o["name"] for o in meta["outputs"]]
        answers[f"{kind}_outputs"] = [np.array(names)]
        requested = [module.InferRequestedOutput(name) for name in names]
        for index in sorted(requests):
            inputs = []
            for name in requests[index]:
                array = data[f"{index}/{name}"]
                datatype = DATATYPES[array.dtype.kind]
                if datatype == "BYTES":
                    array = np.array([bytes(v) for v in array], dtype=np.object_)
                item = module.InferInput(name, list(array.shape), datatype)
                item.set_data_from_numpy(array)
                inputs.append(item)
            result = client.infer(model, inputs, outputs=requested)
            for name in names:
                key = kind if name == "probability" else f"{kind}/{name}"
                answers.setdefault(key, []).append(result.as_numpy(name))
        client.close()
    np.savez(out, **{kind: np.concatenate(parts) for kind, parts in answers.items()})


if __name__ == "__main__":
    main()
