import torch

from fedhier.aggregate import segment_weighted_mean


def test_segment_weighted_mean_matches_direct_formula():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(7, 3, 2, generator=gen)
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    segments = torch.tensor([0, 1, 0, 2, 1, 2, 2])
    out = segment_weighted_mean(values, weights, segments, 3)
    assert out.shape == (3, 3, 2) and out.dtype == torch.float32
    for s in range(3):
        mask = segments == s
        w = weights[mask]
        expected = (values[mask] * w[:, None, None]).sum(0) / w.sum()
        torch.testing.assert_close(out[s], expected, rtol=1e-6, atol=1e-7)


def test_weighted_mean_of_identical_rows_is_exact():
    row = torch.randn(5)
    values = row.repeat(4, 1)
    one_segment = torch.zeros(4, dtype=torch.int64)
    out = segment_weighted_mean(values, torch.tensor([3.0, 1.0, 7.0, 2.0]), one_segment, 1)
    assert torch.equal(out[0], row)


def test_zero_weight_segment_raises():
    import pytest

    with pytest.raises(ValueError):
        segment_weighted_mean(torch.ones(2, 1), torch.zeros(2), torch.tensor([0, 0]), 1)
