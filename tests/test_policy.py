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


def test_small_batches_get_one_token_per_chunk():
    for ntok in range(1, 129):
        assert _C.testing.ep_chunk_tokens(ntok) == 1 and _C.testing.ep_num_chunks(ntok) == ntok


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ep_grids_grow_with_the_batch_and_leave_slack(world):
    last = (0, 0, 0, 0)
    for ntok in (0, 1, 8, 32, 128, 1024, 16384):
        ds, dr = _C.testing.dispatch_grid(ntok, world, H200_SMS)
        cs, cr = _C.testing.combine_grid(ntok, world, H200_SMS)
        # The role with more memory streams per row gets the larger half:
        # dispatch's senders, combine's receivers.
        for larger, smaller in ((ds, dr), (cr, cs)):
            assert 1 <= larger <= H200_SMS // 2 and 1 <= smaller <= H200_SMS // 4
            assert larger + smaller <= 3 * H200_SMS // 4
        cur = (ds, dr, cs, cr)
        assert all(a >= b for a, b in zip(cur, last)), (ntok, cur, last)
        last = cur
    assert _C.testing.dispatch_grid(8, world, H200_SMS) == (8, min(8 * (world - 1), H200_SMS // 4))
    assert _C.testing.dispatch_grid(16384, world, H200_SMS) == (H200_SMS // 2, H200_SMS // 4)
    assert _C.testing.combine_grid(16384, world, H200_SMS) == (H200_SMS // 4, H200_SMS // 2)


def test_allreduce_blocks():
    assert _C.testing.allreduce_blocks(4, H200_SMS) == 1
    assert _C.testing.allreduce_blocks(32 << 10, H200_SMS) == 1
    assert _C.testing.allreduce_blocks((32 << 10) + 1, H200_SMS) == 2
    assert _C.testing.allreduce_blocks(64 << 20, H200_SMS) == H200_SMS // 2
    assert _C.testing.allreduce_blocks(64 << 20, 1) == 1  # a one-SM device still gets a block
