"""The Triton backend's dynamic batch (`answer_requests`): a request that fails, for whatever reason, fails
alone; the other clients' requests in the same batch are answered as if they had come alone.

Triton's Python backend hands `execute` the requests that arrived together; before, any error other than
the decoder's `BadInput` escaped `execute` and Triton failed every request of the batch. Here the real
bundle, model and decoder answer; the only stand-in is a model whose forward fails on one marked request,
standing for any error a single request can raise inside the model (a real one cannot be summoned on demand).
"""
from __future__ import annotations

import numpy as np
import pytest

from services.inference.inputs import InputDecoder
from services.inference.model import load_model
from services.inference.triton_backend import Refusal, answer_requests
from tests.inference_util import make_bundle, random_ids

POISON = 13_000.0
"""A dense value the stand-in model fails on."""


class FailsOnPoison:
    """The real model, except that a micro-batch holding a row whose first dense value is POISON raises."""

    def __init__(self, model):
        self.model = model

    async def predict(self, samples):
        if (np.asarray(samples.dense)[:, 0] == POISON).any():
            raise RuntimeError("the forward pass failed")
        return await self.model.predict(samples)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    bundle = tmp_path_factory.mktemp("bundle") / "bundle"
    _, known = make_bundle(bundle, rows_per_feature=50)
    model = load_model(bundle, compile=False)
    return model, InputDecoder(model.manifest, 4096), known


def _request(known, n: int, seed: int) -> dict[str, np.ndarray]:
    return {"ids": random_ids(known, n, seed=seed).astype(np.int64),
            "dense": np.random.default_rng(seed).random((n, 13), dtype=np.float32)}


def _alone(model, decoder, arrays) -> np.ndarray:
    [answer] = answer_requests(model, decoder, set(), [arrays])
    return answer


def test_a_request_the_model_fails_on_fails_alone(served):
    model, decoder, known = served
    requests = [_request(known, n, seed) for n, seed in ((3, 1), (5, 2), (2, 3))]
    requests[1]["dense"][4, 0] = POISON
    answers = answer_requests(FailsOnPoison(model), decoder, set(), requests)
    assert isinstance(answers[1], Refusal) and not answers[1].bad_input
    assert "RuntimeError: the forward pass failed" in answers[1].message
    for i in (0, 2):
        np.testing.assert_allclose(answers[i], _alone(model, decoder, requests[i]), rtol=1e-6)
        assert answers[i].shape[0] == requests[i]["ids"].shape[0]


def test_a_request_that_cannot_be_decoded_fails_alone_whatever_it_raises(served):
    model, decoder, known = served
    good = _request(known, 4, 7)
    odd = {"ids": good["ids"], "dense": good["dense"].astype(np.complex64)}  # no OIP datatype: a KeyError
    malformed = {"ids": good["ids"][:, :3], "dense": good["dense"]}
    answers = answer_requests(model, decoder, set(), [odd, good, malformed])
    assert isinstance(answers[0], Refusal) and not answers[0].bad_input and "KeyError" in answers[0].message
    assert isinstance(answers[2], Refusal) and answers[2].bad_input
    np.testing.assert_allclose(answers[1], _alone(model, decoder, good), rtol=1e-6)


def test_a_batch_where_every_request_fails_answers_each_with_its_reason(served):
    model, decoder, known = served
    requests = [_request(known, 2, s) for s in (4, 5)]
    for r in requests:
        r["dense"][0, 0] = POISON
    answers = answer_requests(FailsOnPoison(model), decoder, set(), requests)
    assert all(isinstance(a, Refusal) and "forward pass failed" in a.message for a in answers)
