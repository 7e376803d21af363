"""What the ops of :class:`rdna4_comm.Communicator` return: :class:`Dispatched`
(the rank layout), :class:`ExpertDispatched` (the expert layout) and the
:class:`DispatchHandle` of both."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class DispatchHandle(NamedTuple):
    """What :meth:`Communicator.combine` needs from a dispatch. Self-contained:
    it holds no reference to the heap, so handles of several dispatches can be
    combined in any order.

    - ``recv_src``: [W*cap] int32, for each received row ``src_rank * cap + src_token``, -1 for padding.
    - ``counts``: [W] int32, rows received from each source rank.
    - ``src_tokens``: [W] int32, T of each source rank.
    - ``send_mask``: [T] int32, bit ``d`` set when the local token was sent to rank ``d``.
    - ``comm_id``: the communicator that made it.
    - ``token_shape``: the leading dimensions of dispatch's ``x`` (``x.shape[:-1]``),
      which combine's result takes.
    - ``expert_rows_of``: None for the rank layout; for the expert layout
      [W*cap, K] int32, each received row's rows of the expert-layout ``x``
      in ascending local expert order, then -1.
    - ``dispatch_round``: [1] int64 on the op's device, the dispatch's round
      on its communicator, the same on every rank: combine checks that every
      rank combines the same dispatch (docs/semantics.md, "Calls that disagree").
    """

    recv_src: torch.Tensor
    counts: torch.Tensor
    src_tokens: torch.Tensor
    send_mask: torch.Tensor
    comm_id: str
    token_shape: tuple
    expert_rows_of: Optional[torch.Tensor] = None
    dispatch_round: Optional[torch.Tensor] = None


class Dispatched(NamedTuple):
    """Result of :meth:`Communicator.dispatch` on the receiving rank.

    - ``x``: [W*cap, H] of the communicator dtype (torch.float8_e4m3fn for a
      communicator made with ``dispatch_dtype=torch.float8_e4m3fn``). Rows
      ``[0, num_recv)`` are valid, grouped by source rank ascending, within a
      source by source token ascending; later rows are padding, their
      contents unspecified.
    - ``topk_idx``: [W*cap, K] in the dtype of the ids given (int32 or int64),
      the local expert id (global id minus ``rank * num_experts / W``) where the
      slot's expert lives on this rank, else -1. Padding rows are all -1.
    - ``topk_weights``: [W*cap, K] in the dtype of the weights given (float32,
      bfloat16 or float16), 0 where ``topk_idx`` is -1; None when dispatch got
      no weights.
    - ``counts``: [W] int32 on the op's device, rows received from each source;
      ``num_recv = counts.sum()``.
    - ``handle``: :class:`DispatchHandle` for :meth:`Communicator.combine`.
    - ``x_scales``: FP8 dispatch: [W*cap, ceil(H / 128)] torch.float32, the
      scales of x's rows (``rdna4_comm.dequantize_fp8(x, x_scales)``;
      unspecified on padding rows, like x); None otherwise.
    """

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: Optional[torch.Tensor]
    counts: torch.Tensor
    handle: DispatchHandle
    x_scales: Optional[torch.Tensor] = None


class ExpertDispatched(NamedTuple):
    """Result of ``Communicator.dispatch(..., layout="expert")`` on the
    receiving rank: the received rows grouped by local expert, for grouped
    GEMMs (``offs = expert_offsets[1:]``).

    - ``x``: [comm.expert_rows, H] of the communicator dtype (FP8 dispatch:
      torch.float8_e4m3fn). Local expert
      ``e`` owns rows ``[expert_offsets[e], expert_offsets[e] + expert_counts[e])``:
      one row per (source token, e) pair whose token selected e (an id
      repeated in a token's slots routes once), by source rank, then source
      token, ascending. Alignment padding rows are zeros; rows from
      ``expert_offsets[E_loc]`` on are unspecified.
    - ``expert_counts``: [E_loc] int32 on the op's device.
    - ``expert_offsets``: [E_loc + 1] int32 on the op's device, ``0`` first,
      each block's start rounded up to ``expert_alignment``.
    - ``topk_weights``: [comm.expert_rows] in the dtype of the weights given:
      the pair's weight (for an id repeated in a token's slots, the fp32 sum
      of those slots' weights in slot order, rounded once); 0 on padding
      rows; None when dispatch got no weights.
    - ``handle``: :class:`DispatchHandle` (with ``expert_rows_of``) for
      :meth:`Communicator.combine`.
    - ``x_scales``: FP8 dispatch: [comm.expert_rows, ceil(H / 128)]
      torch.float32, the scales of x's rows (zeros on padding rows); None
      otherwise.
    """

    x: torch.Tensor
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    topk_weights: Optional[torch.Tensor]
    handle: DispatchHandle
    x_scales: Optional[torch.Tensor] = None

