"""Communicator's expert-parallel methods, dispatch and combine (a base
class of :class:`rdna4_comm.Communicator`, which holds the state they read:
``_config``, ``_fp8``, ``_order``, ``id``, ``hidden``, ``dtype`` and
``_check_open``)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from .fp8 import FP8_DTYPE
from .ops import op_callable, output_getter
from .results import DispatchHandle, Dispatched, ExpertDispatched

LAYOUTS = ("rank", "expert")

# The dispatch ops' outputs that dispatch reads, by name, in the order it
# unpacks them (the ops' own order is the op table's); the FP8 ops' x_scales
# last.
_READ = {"dispatch": ("x", "topk_idx", "topk_weights", "counts", "recv_src", "src_tokens", "send_mask",
                      "dispatch_round"),
         "dispatch_expert": ("x", "expert_counts", "expert_offsets", "topk_weights", "recv_src", "counts", "src_tokens",
                             "send_mask", "expert_rows_of", "dispatch_round")}
_PICK = {**{op: output_getter(op, *names) for op, names in _READ.items()},
         **{op + "_fp8": output_getter(op + "_fp8", *names, "x_scales") for op, names in _READ.items()}}


class EpMethods:
    def dispatch(
        self, x, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor] = None, *,
        layout: str = "rank",
    ):
        """Send every token to the ranks that own its experts. Collective.

        Args:
            x: [..., H] of the communicator dtype, contiguous: its leading
                dimensions are the tokens (e.g. [T, H] or [B, S, H]), at most
                ``cap`` of them. The token count may differ between ranks and
                may be 0. An FP8 communicator (``dispatch_dtype``) quantises
                it inside the op, bitwise as :func:`rdna4_comm.quantize_fp8`
                does (a NaN's sign and payload aside), or takes the pair
                ``(q, scales)`` that function returns at its block of 128:
                q [..., H] torch.float8_e4m3fn and scales [..., ceil(H / 128)]
                torch.float32 (or [T, ...]), contiguous; they travel as given.
            topk_idx: torch.int32 or torch.int64 global expert ids of shape
                ``x.shape[:-1] + (K,)`` or [T, K]. Ids < 0 or >= num_experts are
                dropped (the slot routes nowhere).
            topk_weights: torch.float32, torch.bfloat16 or torch.float16 of
                topk_idx's shape, or None.
            layout: ``"rank"`` (default) or ``"expert"``.

        Returns:
            ``"rank"``: :class:`Dispatched`, its routing in the dtypes given. A
            token reaches a rank once however many of its experts live
            there: one row per (token, destination rank).
            ``"expert"``: :class:`ExpertDispatched`, the same rows grouped by
            local expert: one row per (token, local expert) pair, with
            per-expert counts and offsets on the device.
            FP8 dispatch: ``x`` is torch.float8_e4m3fn and ``x_scales`` holds
            its scales, the bytes that were sent.
        """
        # The C++ op checks everything else, EP fields included.
        self._check_open()
        x_scales = None
        if not isinstance(x, torch.Tensor):
            x, x_scales = self._fp8_pair(x)
        if layout == "expert":
            op = "dispatch_expert"
        elif layout == "rank":
            op = "dispatch"
        else:
            raise ValueError(f"dispatch: layout must be one of {LAYOUTS}, got {layout!r}")
        if self._fp8:
            op += "_fp8"
            *out, scales = _PICK[op](op_callable(op)(x, x_scales, topk_idx, topk_weights, self._order, self.id))
        else:
            out, scales = _PICK[op](op_callable(op)(x, topk_idx, topk_weights, self._order, self.id)), None
        tokens = x.shape[:-1]
        if layout == "expert":
            rx, ecounts, eoffsets, rw, recv_src, counts, src_tokens, send_mask, rows_of, dispatch_round = out
            handle = DispatchHandle(recv_src, counts, src_tokens, send_mask, self.id, tokens, rows_of, dispatch_round)
            return ExpertDispatched(rx, ecounts, eoffsets, rw if topk_weights is not None else None, handle, scales)
        rx, ridx, rw, counts, recv_src, src_tokens, send_mask, dispatch_round = out
        handle = DispatchHandle(recv_src, counts, src_tokens, send_mask, self.id, tokens, None, dispatch_round)
        return Dispatched(rx, ridx, rw if topk_weights is not None else None, counts, handle, scales)

    def _fp8_pair(self, pair) -> tuple:
        """dispatch's x when it is not a tensor: a (q, scales) pair for an FP8 communicator."""
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            got = f"a sequence of {len(pair)}" if isinstance(pair, (tuple, list)) else type(pair).__name__
            raise TypeError(f"dispatch: x must be a tensor or a (q, scales) pair from rdna4_comm.quantize_fp8, got {got}")
        if not self._fp8:
            raise ValueError(f"dispatch: a (q, scales) pair needs a communicator made with "
                             f"dispatch_dtype={FP8_DTYPE}; this one dispatches {self.dtype}")
        for name, t in zip(("x (the pair's q)", "x_scales (the pair's scales)"), pair):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"dispatch: {name} must be a tensor, got {type(t).__name__}")
        return tuple(pair)

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Return expert results to the tokens' source ranks and sum them. Collective.

        Args:
            y: [W*cap, H] of the communicator dtype, one result row per row that
                dispatch delivered here (the expert side has already applied the
                routing weights and reduced its local experts into that row).
                Padding rows are ignored. For an expert-layout handle,
                [comm.expert_rows, H]: one row per (token, local expert)
                pair, already weighted; each received row's pairs are summed
                first, in fp32 in ascending expert order, rounded once.
            handle: ``Dispatched.handle`` (or ``ExpertDispatched.handle``) of the
                matching dispatch.

        Returns:
            ``handle.token_shape + (H,)`` (dispatch's x shape) of y's dtype: for
            every local token t, the sum over its destination ranks r,
            ascending, of ``y_r[row_r(t)]``, accumulated in float32 and rounded
            once. Tokens routed nowhere give zeros.
        """
        self._check_open()
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"combine: handle must be a DispatchHandle (Dispatched.handle), got {type(handle).__name__}")
        if handle.comm_id != self.id:
            raise ValueError(
                f"combine: handle comes from communicator {handle.comm_id!r}, not from this one ({self.id!r})"
            )
        # Sizes only (no device read, no guard under torch.compile); the C++ op
        # checks every other field (docs/semantics.md, "Bad handles").
        compiling = torch.compiler.is_compiling()
        shape = handle.token_shape
        # numel() of the Size and of the 1-D mask: the cheapest sizes Python has.
        if not compiling and math.prod(shape) != handle.send_mask.numel():
            raise ValueError(
                f"combine: handle.token_shape {tuple(shape)} holds {math.prod(shape)} "
                f"tokens but handle.send_mask has {handle.send_mask.shape[0]}: the fields come from different dispatches"
            )
        if handle.dispatch_round is None:
            raise ValueError("combine: handle.dispatch_round is None: the handle must come from a dispatch of this "
                             "communicator (rdna4_comm.reference's handles describe rows, not a dispatch)")
        if handle.expert_rows_of is not None:
            out = op_callable("combine_expert", compiling)(
                y, handle.expert_rows_of, handle.recv_src, handle.counts, handle.src_tokens, handle.send_mask,
                handle.dispatch_round, self._order, self.id
            )
        else:
            out = op_callable("combine", compiling)(
                y, handle.recv_src, handle.counts, handle.src_tokens, handle.send_mask, handle.dispatch_round,
                self._order, self.id
            )
        # The op returns [T, H]: a flat dispatch needs no view (an op call of
        # its own, on the eager path's host time).
        return out if len(shape) == 1 else out.view(*shape, self.hidden)
