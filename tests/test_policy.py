"""Launch and algorithm policies (csrc/policies.h): the functions the kernels
and the CPU transport use to chunk tokens and size grids."""
from __future__ import annotations

import pytest

from common import H200_SMS, sender_chunk_bytes

from rdna4_comm import _C


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


@pytest.mark.parametrize("sms", [1, 2, 8, H200_SMS, 400])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_ep_grids_split_the_budget_by_streams_and_give_every_block_the_same_tokens(world, sms):
    # All multiprocessors but 2, and no more blocks than have a generation
    # counter each (400 multiprocessors: more than any GPU has today).
    budget = max(2, min(sms - 2, _C.testing.max_launch_blocks))
    own_share = max(1, min(budget * (world + 1) // (3 * world - 1), budget - 1, 128))
    assert _C.testing.ep_own_role_share(world, sms) == own_share
    for ntok in (0, 1, 8, 32, 98, 99, 128, 1000, 4096, 16384, 1 << 18):
        per = _C.testing.ep_own_block_tokens(ntok, world, sms)
        ds, dr = _C.testing.dispatch_grid(ntok, world, sms)
        cs, cr = _C.testing.combine_grid(ntok, world, sms)
        # The role that takes this rank's own tokens (dispatch's senders,
        # combine's receivers): a range of `per` tokens each, the last one
        # shorter but not empty, and no more blocks than its share.
        assert ds == cr == _C.testing.ep_chunks(ntok, per), (ntok, per, ds)
        assert 1 <= ds <= own_share and per == ceil_div(max(ntok, 1), own_share)
        assert ntok == 0 or (ds - 1) * per < ntok <= ds * per
        # The other role: (peer, chunk) items, the rest of the budget.
        assert dr == max(1, min((world - 1) * ds, budget - ds))
        assert cs == max(1, min((world - 1) * _C.testing.ep_num_chunks(ntok), budget - cr))
        assert ds + dr <= budget and cs + cr <= budget
        # A dispatch chunk is a sender block's range: within the chunk slots.
        assert ds <= _C.testing.ep_max_chunks(max(ntok, 1))
    # One block per token up to the role's share; at W = 1 everything but one receiver sends.
    assert _C.testing.dispatch_grid(8, world, H200_SMS)[0] == 8
    if world == 1:
        assert _C.testing.dispatch_grid(4096, 1, H200_SMS) == (128, 1)  # 32 tokens a block, the 128 blocks a role may have
        assert _C.testing.combine_grid(4096, 1, H200_SMS) == (1, 128)


def test_dispatch_senders_route_every_token_while_the_tokens_fit_one_block():
    # Up to a block of tokens (one thread each) every sender block routes them
    # all and needs no other block's count; beyond, it adds up the tallies.
    threads = _C.testing.gpu_block_threads
    assert threads == 512
    for ntok in (0, 1, 8, 128, threads - 1, threads):
        assert _C.testing.dispatch_routes_all_tokens(ntok), ntok
    for ntok in (threads + 1, 4096, 1 << 18):
        assert not _C.testing.dispatch_routes_all_tokens(ntok), ntok


def test_blocks_prefetch_only_rows_a_line_per_thread_covers():
    # A block prefetches the rows it will copy (a dispatch sender's chunk,
    # the expert placement's share) only where 128-byte lines, as many as
    # it has threads, cover them: 64 KiB.
    covered = _C.testing.gpu_block_threads * 128
    for nbytes in (0, 1, 14336, covered - 1, covered):
        assert _C.testing.block_prefetch_covers(nbytes), nbytes
    for nbytes in (covered + 1, 32 * 14336, 1 << 40):
        assert not _C.testing.block_prefetch_covers(nbytes), nbytes

    # bench_kernels' rows on an H200, bf16: T = 8 and 128 prefetch, T = 4096 does not.
    assert _C.testing.block_prefetch_covers(sender_chunk_bytes(8, 1, 4096 * 2))
    assert _C.testing.block_prefetch_covers(sender_chunk_bytes(128, 1, 7168 * 2))
    assert not _C.testing.block_prefetch_covers(sender_chunk_bytes(4096, 1, 7168 * 2))


def test_combine_sums_with_the_short_loop_only_where_no_lane_has_more_vectors():
    # A receiver block sums at most its block's tokens at once, its rows' vectors
    # shared by the block's threads; the short loop keeps 2 a lane in flight.
    threads, short = _C.testing.gpu_block_threads, _C.testing.gpu_short_unroll
    assert short == 2
    for tokens, vectors in ((1, 1), (1, threads), (1, short * threads), (2, threads), (short * threads, 1), (0, 0)):
        assert _C.testing.combine_sums_short(tokens, vectors), (tokens, vectors)
    for tokens, vectors in ((1, short * threads + 1), (3, threads), (short * threads + 1, 1), (32, 896)):
        assert not _C.testing.combine_sums_short(tokens, vectors), (tokens, vectors)

    # bench_kernels' rows on an H200, bf16 rows of 16-byte vectors (H / 8 of them):
    # T = 8 and T = 128 (a token a block) sum short, T = 4096 (32 a block) does not.
    def short_at(ntok, hidden):
        return _C.testing.combine_sums_short(_C.testing.ep_own_block_tokens(ntok, 1, H200_SMS), hidden // 8)

    assert short_at(8, 4096) and short_at(8, 7168) and short_at(128, 7168)
    assert not short_at(4096, 7168)


def test_dispatch_routing_warp_where_one_warp_has_a_lane_for_every_slot():
    lanes = _C.testing.gpu_routing_lanes
    assert lanes == 32
    for rows, topk in ((1, 8), (4, 8), (1, 32), (32, 1), (2, 16), (0, 8)):
        assert _C.testing.dispatch_routing_warp(rows, topk), (rows, topk)
    for rows, topk in ((5, 8), (1, 33), (33, 1), (3, 11)):
        assert not _C.testing.dispatch_routing_warp(rows, topk), (rows, topk)

    # bench_kernels' rows on an H200, top-8: a sender block's batch at T = 8 and
    # T = 128 (a token a block) has a routing warp, at T = 4096 (32 a block) not.
    def routing_warp_at(ntok):
        return _C.testing.dispatch_routing_warp(_C.testing.ep_own_block_tokens(ntok, 1, H200_SMS), 8)

    assert routing_warp_at(8) and routing_warp_at(128)
    assert not routing_warp_at(4096)


def test_expert_owner_counts_the_rank_runs_below_the_id():
    for world in (1, 2, 3, 8, 32):
        epr = 5
        for e in range(-2, world * epr + 3):
            expected = e // epr if 0 <= e < world * epr else -1
            assert _C.testing.expert_owner(e, world * epr, epr, world) == expected, (world, e)
    assert _C.testing.expert_owner(1 << 40, 1 << 41, 1 << 40, 2) == 1  # ids past 32 bits


def test_allreduce_blocks():
    assert _C.testing.allreduce_blocks(4, H200_SMS) == 1
    assert _C.testing.allreduce_blocks(32 << 10, H200_SMS) == 1
    assert _C.testing.allreduce_blocks((32 << 10) + 1, H200_SMS) == 2
    assert _C.testing.allreduce_blocks(64 << 20, H200_SMS) == H200_SMS // 2
    assert _C.testing.allreduce_blocks(64 << 20, 1) == 1  # a one-SM device still gets a block
    # Every block of a grid has a generation counter (kMaxLaunchBlocks of them).
    assert _C.testing.allreduce_blocks(1 << 40, 4000) <= _C.testing.max_launch_blocks


@pytest.mark.parametrize("sms", [1, 8, H200_SMS])
@pytest.mark.parametrize("resident", [0, 1, 2, 4])
def test_expert_layout_grids_cover_the_rows_in_one_wave(sms, resident):
    # The tally: a warp per chunk of 32 rows, a block of 16 warps, capped at
    # 4 blocks per multiprocessor. The placement and the sums: a block per
    # row, at least one per multiprocessor (rows are sliced among them), and
    # at most the blocks the multiprocessors hold at once (`resident` per
    # multiprocessor; a kernel the runtime gave no answer for counts as 1):
    # one wave, so that a decode step's blocks without rows are not a
    # second wave (the kernels loop over what is left).
    chunk_rows, warps = _C.testing.expert_chunk_rows, _C.testing.gpu_block_threads // 32
    assert chunk_rows == 32
    wave = max(resident, 1) * sms
    for rows in (1, 8, 31, 32, 33, 512, 513, 4096, 8 * 4096, 8 << 18):
        chunks = _C.testing.expert_chunks(rows)
        assert chunks == ceil_div(rows, chunk_rows)
        assert _C.testing.expert_chunk_blocks(rows, sms) == min(ceil_div(chunks, warps), 4 * sms)
        assert _C.testing.expert_row_blocks(rows, sms, resident) == min(max(rows, sms), wave)
    # A prefill-sized capacity: the whole wave (an H200's placement kernel
    # holds one 512-thread block a multiprocessor).
    assert _C.testing.expert_row_blocks(4096, H200_SMS, 1) == H200_SMS


@pytest.mark.parametrize("sms", [1, 8, H200_SMS])
def test_expert_rows_are_sliced_so_a_few_rows_spread_over_the_grid(sms):
    # A grid with more blocks than rows received cuts each row into slices
    # of ceil(vectors / slices) vectors, a block's share each: as many as
    # the blocks allow and slices of about expert_slice_bytes allow, and
    # none left empty by the rounding.
    least = _C.testing.expert_slice_bytes
    assert least == 1024
    for cap_rows in (8, 32, 4096, 8 * 4096):
        blocks = _C.testing.expert_row_blocks(cap_rows, sms, 1)
        for received in (0, 1, 8, 33, 512, 4096):
            if received > cap_rows:
                continue
            # (row bytes, vectors): 16-byte vectors, bf16 elements, bytes.
            for row_bytes, vectors in ((1, 1), (1024, 64), (2047, 2047), (14336, 896), (14336, 7168), (7168, 7168),
                                       (1 << 20, 1 << 16), (67600, 4225)):
                slices = _C.testing.expert_row_slices(received, row_bytes, vectors, blocks)
                most = max(1, min(blocks // max(received, 1), row_bytes // least))
                assert 1 <= slices <= most, (received, row_bytes, vectors)
                width = ceil_div(vectors, slices)
                assert (slices - 1) * width < vectors  # the last slice has vectors
                if most > 1 and vectors > 1:
                    assert width == ceil_div(vectors, most)
    # A decode step (8 rows of H = 7168 bf16: 14336 bytes in 896 16-byte
    # vectors) on an H200 takes 8 * 14 = 112 of the grid's blocks, on
    # either capacity; a prefill's rows are not sliced.
    for cap_rows in (8, 4096):
        blocks = _C.testing.expert_row_blocks(cap_rows, H200_SMS, 1)
        assert 8 * _C.testing.expert_row_slices(8, 14336, 896, blocks) == 112
    assert _C.testing.expert_row_slices(4096, 14336, 896, _C.testing.expert_row_blocks(4096, H200_SMS, 1)) == 1


@pytest.mark.parametrize("sms", [1, 8, H200_SMS])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_combine_receivers_slice_pair_rows_over_the_blocks_the_senders_leave(world, sms):
    # Receivers that sum an expert layout's pair rows cut their range's rows
    # into column slices, a block each: expert_row_slices' rule over the
    # receiver ranges and the blocks the senders leave, so the grid stays
    # within the EP budget. The rank layout's receivers keep whole rows, and
    # so does a rank without tokens (its one range only waits).
    budget = max(2, min(sms - 2, _C.testing.max_launch_blocks))
    for ntok in (0, 1, 8, 128, 4096):
        send, recv = _C.testing.combine_grid(ntok, world, sms)
        for row_bytes, vectors in ((14336, 896), (14336, 7168), (16384, 1024), (64, 4), (2, 1)):
            assert _C.testing.combine_recv_slices(ntok, world, sms, row_bytes, vectors, False) == 1
            slices = _C.testing.combine_recv_slices(ntok, world, sms, row_bytes, vectors, True)
            assert slices == (1 if ntok == 0 else _C.testing.expert_row_slices(recv, row_bytes, vectors, budget - send))
            assert 1 <= slices and send + recv * slices <= budget
            # launch_combine's slices of ceil(vectors / slices) vectors: none empty.
            assert (slices - 1) * ceil_div(vectors, slices) < vectors
    # A decode step of H = 7168 bf16 (896 16-byte vectors a row) on an H200:
    # its 8 receiver ranges take 14 slices of 64 vectors each; a prefill's
    # ranges keep whole rows.
    if world == 1:
        assert _C.testing.combine_recv_slices(8, 1, H200_SMS, 14336, 896, True) == 14
        assert _C.testing.combine_recv_slices(4096, 1, H200_SMS, 14336, 896, True) == 1


@pytest.mark.parametrize("sms", [1, 8, H200_SMS])
@pytest.mark.parametrize("resident", [0, 1, 2])
def test_expert_placement_grid_has_a_warp_per_padding_row(sms, resident):
    # Expert e's alignment padding is at most alignment - 1 rows, each zeroed
    # by a warp of its own (16 warps of 32 lanes in a block), as far as the
    # grid's one wave allows; without padding the grid is the rows' grid.
    warps = _C.testing.gpu_block_threads // 32
    for rows in (1, 8, 4096):
        for experts, alignment in ((1, 1), (256, 1), (256, 16), (64, 128), (1, 128)):
            want = max(rows, ceil_div(experts * (alignment - 1), warps))
            blocks = _C.testing.expert_place_blocks(rows, experts, alignment, sms, resident)
            assert blocks == min(max(want, sms), max(resident, 1) * sms)
            assert blocks >= _C.testing.expert_row_blocks(rows, sms, resident)


def test_expert_placement_of_one_chunk_runs_as_one_kernel():
    # Rows received that fit one chunk (the 32 lanes of a tally word) are
    # placed by one kernel, whose blocks keep a word per local expert for
    # two tables in shared memory; the host launches the tally and offsets
    # kernels only where W * cap rows can fill more than one chunk.
    chunk, most = _C.testing.expert_chunk_rows, _C.testing.expert_one_chunk_experts
    assert most == 1024
    for experts in (1, 8, 256, most, most + 1, 4096):
        for received in (0, 1, 8, chunk, chunk + 1, 4096):
            one = received <= chunk and experts <= most
            assert _C.testing.expert_places_one_chunk(received, experts) == one
            assert _C.testing.expert_tally_launched(received, experts) == (not one)
    # A decode step of 8 tokens on 1 to 4 ranks (top-8 of 256): one kernel on
    # a capacity of 8; on a prefill-sized capacity the tally is launched and
    # returns at once.
    for world in (1, 2, 4):
        assert not _C.testing.expert_tally_launched(world * 8, 256 // world)
        assert _C.testing.expert_places_one_chunk(world * 8, 256 // world)
        assert _C.testing.expert_tally_launched(world * 4096, 256 // world)


def test_signal_region_does_not_grow_with_the_capacity():
    # Chunk slots and combine flags are per (parity, source, chunk), and a
    # source publishes at most 128 chunks whatever its token count.
    sizes = {cap: _C.testing.heap_bytes(8, cap, 7168, 8, 2, 1 << 20) for cap in (128, 4096, 262144)}
    signals = {cap: sig for cap, (sig, _) in sizes.items()}
    # About 131 KiB (the tally takes a word per block and destination) at any capacity.
    assert signals[128] == signals[4096] == signals[262144] < 136 << 10, signals  # was ~96 MiB at 262144
    assert _C.testing.heap_bytes(8, 4, 7168, 8, 2, 1 << 20)[0] < signals[128]  # fewer chunks below 128 tokens
    datas = [data for _, data in sizes.values()]
    assert datas[0] < datas[1] < datas[2]  # the row buffers do grow with it
