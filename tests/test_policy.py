"""Launch and algorithm policies (csrc/protocol.h): the functions the kernels
and the CPU transport use to chunk tokens and size grids."""
from __future__ import annotations

import pytest

from rdna4_comm import _C

H200_SMS = 132


@pytest.mark.parametrize("ntok", [0, 1, 7, 8, 127, 128, 129, 1000, 4096, 16384, 65536, 1 << 20])
def test_token_chunks_cover_the_batch_in_at_most_128_chunks(ntok):
    c, n = _C.testing.ep_chunk_tokens(ntok), _C.testing.ep_num_chunks(ntok)
    assert c >= 1 and 1 <= n <= 128
    if ntok == 0:
        assert n == 1  # an empty batch still publishes one (empty) chunk
    else:
        assert (n - 1) * c < ntok <= n * c


def test_max_chunks_bounds_every_batch_the_capacity_allows():
    # ep_num_chunks is not monotone (200 tokens: 100 chunks; 257: 86), so the
    # chunk slots and the bad-handle fallback take ep_max_chunks(cap).
    most = 0
    for cap in range(0, 2100):
        most = max(most, _C.testing.ep_num_chunks(cap))
        assert _C.testing.ep_max_chunks(cap) == max(1, most), cap
    assert _C.testing.ep_num_chunks(257) < _C.testing.ep_num_chunks(200)


def test_small_batches_get_one_token_per_chunk():
    for ntok in range(1, 129):
        assert _C.testing.ep_chunk_tokens(ntok) == 1 and _C.testing.ep_num_chunks(ntok) == ntok


def ceil_div(a, b):
    return -(-a // b)


@pytest.mark.parametrize("sms", [1, 2, 8, H200_SMS])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_ep_grids_split_the_budget_by_streams_and_spread_chunks_evenly(world, sms):
    budget = max(2, sms * 3 // 4)
    own_share = min(budget * (world + 1) // (3 * world - 1), budget - 1)
    for ntok in (0, 1, 8, 32, 98, 99, 128, 1000, 4096, 16384, 1 << 18):
        nch = _C.testing.ep_num_chunks(ntok)
        ds, dr = _C.testing.dispatch_grid(ntok, world, sms)
        cs, cr = _C.testing.combine_grid(ntok, world, sms)
        # The role that takes this rank's own chunks (dispatch's senders,
        # combine's receivers) and the one that takes (peer, chunk) items.
        for own, peer in ((ds, dr), (cr, cs)):
            assert 1 <= own <= max(1, own_share) and 1 <= peer and own + peer <= budget, (ntok, own, peer)
            assert peer == max(1, min((world - 1) * nch, budget - own))
            # As few chunks on the busiest block as the share allows, and no
            # block with more chunks than another's plus none.
            assert ceil_div(nch, own) == ceil_div(nch, min(nch, max(1, own_share)))
            assert (own - 1) * ceil_div(nch, own) < nch
    # One block per token up to the role's share; at W = 1 everything but one receiver sends.
    assert _C.testing.dispatch_grid(8, world, H200_SMS) == (8, max(1, min(8 * (world - 1), 99 - 8)))
    if world == 1:
        assert _C.testing.dispatch_grid(4096, 1, H200_SMS) == (64, 1)  # 128 chunks, two each
        assert _C.testing.combine_grid(4096, 1, H200_SMS) == (1, 64)


def test_allreduce_blocks():
    assert _C.testing.allreduce_blocks(4, H200_SMS) == 1
    assert _C.testing.allreduce_blocks(32 << 10, H200_SMS) == 1
    assert _C.testing.allreduce_blocks((32 << 10) + 1, H200_SMS) == 2
    assert _C.testing.allreduce_blocks(64 << 20, H200_SMS) == H200_SMS // 2
    assert _C.testing.allreduce_blocks(64 << 20, 1) == 1  # a one-SM device still gets a block


def test_signal_region_does_not_grow_with_the_capacity():
    # Chunk slots and combine flags are per (parity, source, chunk), and a
    # source publishes at most 128 chunks whatever its token count.
    sizes = {cap: _C.testing.heap_bytes(8, cap, 7168, 8, 2, 1 << 20) for cap in (128, 4096, 262144)}
    signals = {cap: sig for cap, (sig, _) in sizes.items()}
    assert signals[128] == signals[4096] == signals[262144] < 128 << 10, signals  # was ~96 MiB at 262144
    assert _C.testing.heap_bytes(8, 4, 7168, 8, 2, 1 << 20)[0] < signals[128]  # fewer chunks below 128 tokens
    datas = [data for _, data in sizes.values()]
    assert datas[0] < datas[1] < datas[2]  # the row buffers do grow with it
