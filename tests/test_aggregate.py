import torch

from fedhier.round.aggregators.averaging import segment_weighted_mean


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


def _one_call(values, weights, segments, num_segments):
    """The untiled computation: one float64 index_add_ over all members, in member order."""
    w = weights.to(torch.float64)
    totals = torch.zeros(num_segments, dtype=torch.float64).index_add_(0, segments, w)
    flat = values.reshape(len(values), -1).to(torch.float64)
    acc = torch.zeros(num_segments, flat.shape[1], dtype=torch.float64)
    acc.index_add_(0, segments, flat * w[:, None])
    return (acc / totals[:, None]).to(values.dtype).reshape(num_segments, *values.shape[1:])


def test_tiles_give_one_calls_result_bit_for_bit(monkeypatch):
    """Tiles of rows and columns (forced small here) add the same terms in the same order as
    one call: not one bit differs, whatever the segment order or the tile shape. (float64
    values: a float32 result would round away a change of order.)"""
    import fedhier.round.aggregators.averaging as aggregate

    gen = torch.Generator().manual_seed(3)
    cases = [(300, (7, 11), 40), (50, (1000,), 1), (400, (9,), 400), (5, (3, 3), 5)]
    for block, min_columns in [(64, 4), (50, 1), (1000, 300)]:
        monkeypatch.setattr(aggregate, "AGGREGATE_BLOCK", block)
        monkeypatch.setattr(aggregate, "MIN_TILE_COLUMNS", min_columns)
        for members, shape, num_segments in cases:
            values = torch.randn(members, *shape, generator=gen,
                                 dtype=torch.float64) * 10.0 ** torch.randint(
                -3, 4, (members, 1), generator=gen).reshape(members, *([1] * len(shape)))
            weights = torch.rand(members, generator=gen, dtype=torch.float64) * 50 + 0.5
            segments = torch.randperm(members, generator=gen) % num_segments
            tiled = aggregate.segment_weighted_mean(values, weights, segments, num_segments)
            assert torch.equal(tiled, _one_call(values, weights, segments, num_segments))
            columns, rows = aggregate._tiles(members, values[0].numel(), num_segments)
            assert columns * rows <= max(block, columns) and columns >= 1


def test_tiles_are_wide_and_bounded():
    from fedhier.round.aggregators.averaging import AGGREGATE_BLOCK, MIN_TILE_COLUMNS, _tiles

    # 100,000 clients into 10,000 edges: contiguous runs of 256 columns, not 2
    assert _tiles(100_000, 9_610, 10_000) == (MIN_TILE_COLUMNS, AGGREGATE_BLOCK // 256)
    # one member per segment at 100,000: the float64 sum stays at 16 tiles' entries
    columns, _ = _tiles(100_000, 9_610, 100_000)
    assert 100_000 * columns <= 16 * AGGREGATE_BLOCK
    # few members, many columns: one tile holds all rows
    assert _tiles(10, 4_000_000, 1) == (AGGREGATE_BLOCK // 10, 10)
    assert _tiles(3, 5, 1) == (5, AGGREGATE_BLOCK // 5)
