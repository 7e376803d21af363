"""What the ops of :class:`rdna4_comm.Communicator` return: :class:`Dispatched`
and its :class:`DispatchHandle`."""
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
    """

    recv_src: torch.Tensor
    counts: torch.Tensor
    src_tokens: torch.Tensor
    send_mask: torch.Tensor
    comm_id: str
    token_shape: tuple


class Dispatched(NamedTuple):
    """Result of :meth:`Communicator.dispatch` on the receiving rank.

    - ``x``: [W*cap, H] of the communicator dtype. Rows ``[0, num_recv)`` are
      valid, grouped by source rank ascending, within a source by source token
      ascending; later rows are padding, their contents unspecified.
    - ``topk_idx``: [W*cap, K] in the dtype of the ids given (int32 or int64),
      the local expert id (global id minus ``rank * num_experts / W``) where the
      slot's expert lives on this rank, else -1. Padding rows are all -1.
    - ``topk_weights``: [W*cap, K] in the dtype of the weights given (float32,
      bfloat16 or float16), 0 where ``topk_idx`` is -1; None when dispatch got
      no weights.
    - ``counts``: [W] int32 on the op's device, rows received from each source;
      ``num_recv = counts.sum()``.
    - ``handle``: :class:`DispatchHandle` for :meth:`Communicator.combine`.
    """

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: Optional[torch.Tensor]
    counts: torch.Tensor
    handle: DispatchHandle
