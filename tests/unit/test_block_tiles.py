"""ds_muon.core.block_tiles and the Adam-mini shard update built on it, against the written-out per-segment
computation: random layouts (blocks of 1 to 300 elements, padding, blocks cut by window boundaries), every
tile size from 1 to larger than the shard, the compiled pass (``eager`` backend: same tracing and guards)
with its graph count, and the choice of the tile size on the 934M layout's segment lengths."""
from __future__ import annotations

import random

import pytest
import torch

from ds_muon.core import adam_update as au
from ds_muon.core.block_tiles import block_tiles, choose_tile

PAD = -1


def _layout(seed: int, n_blocks: int = 40) -> tuple[list[int], list[int]]:
    """Segments of a shard: every block one contiguous range of 1..300 elements, in block order, some padding
    between them, a block or two absent from this rank."""
    rng = random.Random(seed)
    lengths, ids = [], []
    for b in range(n_blocks):
        if rng.random() < 0.2:
            lengths.append(rng.randint(1, 40))
            ids.append(PAD)
        if rng.random() < 0.05:
            continue  # this block has no element on this rank
        lengths.append(rng.choice([1, 2, 7, 64, 100, 128, 300, rng.randint(1, 300)]))
        ids.append(b)
    lengths.append(rng.randint(1, 50))
    ids.append(PAD)
    return lengths, ids


def _expand(values: torch.Tensor, lengths: list[int], ids: list[int]) -> torch.Tensor:
    """Per element: its block's value, 1 for padding (the old per-segment form)."""
    ext = torch.cat([values, values.new_ones(1)])
    idx = torch.tensor([len(values) if b < 0 else b for b in ids])
    return torch.repeat_interleave(ext[idx], torch.tensor(lengths))


def _sums(x: torch.Tensor, lengths: list[int], ids: list[int], n_blocks: int) -> torch.Tensor:
    out = torch.zeros(n_blocks, dtype=torch.float64)
    pos = 0
    for n, b in zip(lengths, ids):
        if b >= 0:
            out[b] += x[pos:pos + n].double().square().sum()
        pos += n
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tile", [1, 3, 16, 64, 97, None, 1 << 16])
def test_sums_and_update_match_the_per_segment_form(seed: int, tile) -> None:
    n_blocks = 40
    lengths, ids = _layout(seed, n_blocks)
    n = sum(lengths)
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen)
    tiles = block_tiles(lengths, ids, n_blocks, torch.device("cpu"), tile=tile)
    assert tiles.numel == n and tiles.mixed_numel == tiles.mixed_rows.numel() * tiles.tile + n - tiles.n_full * tiles.tile
    torch.testing.assert_close(tiles.sums_of_squares(g).double(), _sums(g, lengths, ids, n_blocks), rtol=1e-5, atol=1e-6)
    # apply_: p <- p + m * d per element (d: the block's value, 1 for padding), m <- m + g
    p, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    values = torch.rand(n_blocks, generator=gen) + 0.5
    want_p, want_m = p + (m + g) * _expand(values, lengths, ids), m + g

    def fn(p, g, m, d):
        m.add_(g)
        p.addcmul_(m, d)

    tiles.apply_(fn, [p, g, m], torch.cat([values, values.new_ones(1)]), mutated=(0, 2))
    assert torch.equal(m, want_m)
    torch.testing.assert_close(p, want_p)


def test_windows_cut_blocks_and_the_update_equals_the_whole_tensor_formula() -> None:
    """adam_mini_shard_update_ over windows of 97 elements (chunk) and over one window: the same result as the
    element-wise formula with per-element denominators (bit for bit: same operations per element), and the
    same block sums up to summation order."""
    n_blocks = 40
    lengths, ids = _layout(7, n_blocks)
    n = sum(lengths)
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(n, generator=gen)
    numel = torch.zeros(n_blocks)
    for k, b in zip(lengths, ids):
        if b >= 0:
            numel[b] = k * 2  # the block's global numel: half of it on this rank
    sums = _sums(g, lengths, ids, n_blocks).float()
    results = []
    for chunk in (None, 97):
        windows = au.shard_chunks(lengths, ids, n_blocks, torch.device("cpu"), chunk=chunk)
        assert len(windows) == (1 if chunk is None else -(-n // 97))
        torch.testing.assert_close(au.block_square_sums(g, windows, n_blocks), sums, rtol=1e-5, atol=1e-6)
        p, m, v = torch.ones(n), torch.zeros(n), torch.zeros(n_blocks)
        for step in (1, 2):
            au.adam_mini_shard_update_(p, g, m, v, sums * step, numel, windows, step, 1e-2, (0.9, 0.95), 1e-8, 0.1)
        results.append((p, m, v))
    p, m, v = torch.ones(n), torch.zeros(n), torch.zeros(n_blocks)  # the formula, written out
    for step in (1, 2):
        v.mul_(0.95).add_(sums * step / numel, alpha=0.05)
        denom = _expand(au.adam_denominator(v, step, 0.95, 1e-8), lengths, ids)
        au.adam_apply_(p, g, m, denom, step, 1e-2, 0.9, 0.1)
    for got in results:
        for a, b in zip(got, (p, m, v)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_pass_same_result_one_graph(backend: str) -> None:
    """The compiled element-wise pass gives the eager result to fp32 rounding and adds one graph for new
    learning rates and steps (a float passed as ``alpha=``/``value=`` would be specialized by inductor and
    recompile every step); a second shard of another size and tile reuses it (dynamic shapes). The
    ``eager`` backend (same tracing and guards) and, where a C++ compiler is found, inductor itself."""
    import shutil
    from torch._dynamo.utils import counters
    if backend == "inductor" and not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("inductor on CPU needs a C++ compiler")
    torch._dynamo.reset()
    counters.clear()
    try:
        outs = []
        for compiled in (False, True):
            for seed, tile in ((3, 64), (5, 128)):
                lengths, ids = _layout(seed)
                n = sum(lengths)
                g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
                windows = au.shard_chunks(lengths, ids, 40, torch.device("cpu"), tile=tile)
                p, m, v = torch.ones(n), torch.zeros(n), torch.zeros(40)
                sums = au.block_square_sums(g, windows, 40)
                for step, lr in ((1, 1e-2), (2, 5e-3), (3, 2e-3)):
                    au.adam_mini_shard_update_(p, g, m, v, sums, torch.full((40,), 300.0), windows, step, lr,
                                               (0.9, 0.95), 1e-8, 0.1, compiled=compiled, backend=backend)
                outs.append((p, m))
        for (pe, me), (pc, mc) in zip(outs[:2], outs[2:]):
            torch.testing.assert_close(mc, me, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(pc, pe, rtol=1e-6, atol=1e-7)
        assert int(counters["stats"].get("unique_graphs", 0)) == 1
    finally:
        torch._dynamo.reset()


def test_tile_choice_on_the_934m_layout() -> None:
    """Two decoder layers of the 934M preset (d 2048, 16 heads of 128, SwiGLU 5440) at W=1, in the model's order:
    the default rule's blocks are multiples of 2048 elements and the norms 2048, so 2048-element tiles have no
    mixed tile; the neuron rule's rows of 5440 (down_proj) are multiples of 64. Either way the cached index is a
    small fraction of the shard's bytes and nothing is per element."""
    d, f = 2048, 5440
    layers = {"default": ([d] + [128 * d] * 32 + [d * d] * 2 + [d] + [f * d] * 3) * 2,
              "neuron": ([d] + [128 * d] * 32 + [d] * (2 * d) + [d] + [d] * (2 * f) + [f] * d) * 2}
    for rule, want in (("default", 2048), ("neuron", 64)):
        lengths = layers[rule]
        assert choose_tile(lengths) == want, rule
        tiles = block_tiles(lengths, list(range(len(lengths))), len(lengths), torch.device("cpu"))
        assert tiles.tile == want and tiles.mixed_numel == 0 and tiles.n_full * want == tiles.numel, rule
        assert tiles.nbytes() < 0.02 * 4 * tiles.numel, (rule, tiles.nbytes())
