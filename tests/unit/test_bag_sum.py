"""hybridrec.pooling.bag_sum: the same values and gradients as autograd's embedding_bag, with a compiled backward."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hybridrec.pooling import bag_sum


def _bags(seed: int, num_bags: int, num_rows: int, max_len: int):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len + 1, num_bags)
    lengths[0] = lengths[-1] = 0  # empty bags first and last
    index = torch.from_numpy(rng.integers(0, num_rows, int(lengths.sum())))
    offsets = torch.from_numpy(np.cumsum(lengths) - lengths)
    return index, offsets, torch.from_numpy(rng.random(int(lengths.sum())).astype(np.float32))


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("max_len", [1, 5])
def test_bag_sum_matches_embedding_bag_forward_and_backward(weighted, max_len):
    index, offsets, weights = _bags(max_len, num_bags=3000, num_rows=400, max_len=max_len)
    weights = weights if weighted else None
    rows = torch.randn(400, 16)
    upstream = torch.randn(3000, 16)
    ours, ref = rows.clone().requires_grad_(), rows.clone().requires_grad_()
    out = bag_sum(ours, index, offsets, weights)
    expected = F.embedding_bag(index, ref, offsets, mode="sum", per_sample_weights=weights)
    torch.testing.assert_close(out, expected)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-5, atol=1e-5)
    assert ours.grad.abs().sum() > 0


def test_bag_sum_of_a_view_and_without_gradient():
    index, offsets, _ = _bags(0, num_bags=64, num_rows=10, max_len=3)
    rows = torch.randn(10, 4, requires_grad=True)
    out = bag_sum(rows, index, offsets, None).view(2, 32, 4)
    out[1].sum().backward()  # only the second half of the bags gets a gradient
    ref = torch.zeros(10, 4)
    for b in range(32, 64):
        end = int(offsets[b + 1]) if b + 1 < 64 else index.shape[0]
        for k in range(int(offsets[b]), end):
            ref[index[k]] += 1
    torch.testing.assert_close(rows.grad, ref)
    with torch.no_grad():
        torch.testing.assert_close(bag_sum(rows, index, offsets, None),
                                   F.embedding_bag(index, rows, offsets, mode="sum"))
