// The CPU transport's dispatch and combine (cpu_comm.h).
#include "cpu_comm.h"

#include <ATen/Dispatch.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../calls.h"
#include "../flags.h"
#include "../policies.h"
#include "../routing.h"
#include "cpu_arith.h"

namespace rdna4_comm {
namespace cpu {

// dispatch, as the GPU's sender and receiver blocks run it: one header per
// destination, rows pushed chunk by chunk (ep_chunk_tokens) with one
// ChunkSlot per (destination, chunk), empty chunks included; this rank's
// own rows go straight from x to the output; the receiver takes the peers'
// chunks in chunk-major order. Everything is published before the first
// wait, so no rank waits for a peer that waits for it. Ids and weights are
// read and written in the caller's dtypes. The members keep the sizes'
// names of docs/semantics.md (W, T, K, cap, H; epr experts per rank, S FP8
// scales per row, C tokens per chunk).
template <typename IdxT, typename WT>
class CpuComm::Dispatch {
 public:
  Dispatch(CpuComm& comm, const at::Tensor& x, bool pair, const float* x_scales, const IdxT* ids, const WT* weights,
           Dispatched& out)
      : comm(comm),
        layout(comm.layout_),
        W(comm.cfg_.world),
        me(comm.cfg_.rank),
        T(x.size(0)),
        K(comm.cfg_.topk),
        cap(comm.cfg_.cap),
        epr(comm.cfg_.experts_per_rank()),
        H(comm.cfg_.hidden),
        S(layout.fp8_scales),
        in_row(H * int64_t(x.element_size())),
        payload(S ? H : H * comm.cfg_.elt),
        C(ep_chunk_tokens(T)),
        nch(ep_num_chunks(T)),
        x_dtype(x.scalar_type()),
        xp(static_cast<const char*>(x.data_ptr())),
        x_scales(x_scales),
        ids(ids),
        weights(weights),
        out(out),
        mask_out(out.send_mask.data_ptr<int32_t>()),
        rx(static_cast<char*>(out.x.data_ptr())),
        scales_out(S ? out.x_scales.data_ptr<float>() : nullptr),
        rid_out(out.topk_idx.data_ptr<IdxT>()),
        // With T = 0 the weights may be given yet have no storage: out's shape says.
        rw_out(out.topk_weights.size(0) > 0 ? out.topk_weights.data_ptr<WT>() : nullptr),
        src_out(out.recv_src.data_ptr<int32_t>()),
        quantised(S && !pair ? size_t(H) : 0),
        quantised_scales(quantised.empty() ? 0 : size_t(S)) {}

  void run() {
    gen = comm.begin_round(kOpDispatch, comm.call_);
    *out.dispatch_round.data_ptr<int64_t>() = int64_t(comm.round_);
    route();
    publish_heads();
    send_chunks();
    place_own_rows();
    mark_padding(receive_chunks());
    comm.finish_op(kOpDispatch, gen);
  }

 private:
  // Destination sets into send_mask, and start[c * W + d]: rows to d from
  // the tokens before chunk c.
  void route() {
    start.assign(size_t(nch + 1) * W, 0);
    for (int64_t t = 0; t < T; ++t) {
      uint32_t mask = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int owner = expert_owner(int64_t(ids[t * K + k]), comm.cfg_.num_experts, epr, W);
        if (owner >= 0) mask |= 1u << owner;
      }
      mask_out[t] = int32_t(mask);
      for (int d = 0; d < W; ++d) start[size_t(t / C + 1) * W + d] += mask >> d & 1u;
    }
    for (int64_t c = 0; c < nch; ++c)
      for (int d = 0; d < W; ++d) start[size_t(c + 1) * W + d] += start[size_t(c) * W + d];
  }
  uint32_t rows_to(int64_t c, int d) const { return start[size_t(c) * W + d]; }
  bool sends(int64_t t, int d) const { return uint32_t(mask_out[t]) >> d & 1u; }

  void publish_heads() {
    for (int d = 0; d < W; ++d) {
      HeadSlot* head = layout.dispatch_head(comm.signals(d), gen, me);
      head->ntok = uint32_t(T);
      head->nrows = rows_to(nch, d);
      head->chunk_tokens = uint32_t(C);
      store_release(&head->gen, gen);
    }
  }

  // Peers' rows, chunk by chunk, each chunk announced to every peer.
  void send_chunks() {
    std::vector<uint32_t> next(W);
    for (int64_t c = 0; c < nch; ++c) {
      for (int d = 0; d < W; ++d) next[d] = rows_to(c, d);
      for (int64_t t = c * C; t < std::min((c + 1) * C, T); ++t) {
        for (int d = 0; d < W; ++d) {
          if (d == me || !sends(t, d)) continue;
          char* row = layout.dispatch_row(comm.data(d), gen, me, next[d]++);
          put_row(t, row, layout.row_scales(row));
          put_routing(t, d, layout.row_ids(row), layout.row_weights(row));
          *layout.row_token(row) = int32_t(t);
        }
      }
      for (int d = 0; d < W; ++d) {
        if (d == me) continue;
        ChunkSlot* slot = layout.dispatch_chunk(comm.signals(d), gen, me, c);
        slot->row_start = rows_to(c, d);
        slot->nrows = rows_to(c + 1, d) - rows_to(c, d);
        store_release(&slot->gen, gen);
      }
    }
  }

  // This rank's own rows skip the heap: straight to the output, after the
  // rows of every lower rank, whose counts come from their headers.
  void place_own_rows() {
    int64_t own = 0;
    for (int s = 0; s < me; ++s) {
      const HeadSlot* head = layout.dispatch_head(comm.signals(me), gen, s);
      comm.wait_at_least(&head->gen, gen, kOpDispatch, s);
      own += head->nrows;
    }
    for (int64_t t = 0; t < T; ++t) {
      if (!sends(t, me)) continue;
      put_row(t, rx + own * payload, scales_out + own * S);
      put_routing(t, me, rid_out + own * K, rw_out ? rw_out + own * K : static_cast<WT*>(nullptr));
      src_out[own++] = int32_t(me * cap + t);
    }
  }

  // Every source's header, then the peers' chunks in chunk-major order, each
  // to its source's rows (sources in rank order). Returns the rows received.
  int64_t receive_chunks() {
    int32_t* counts = out.counts.data_ptr<int32_t>();
    int32_t* src_tokens = out.src_tokens.data_ptr<int32_t>();
    std::vector<int64_t> offset(W + 1, 0), nchunks(W, 0);
    for (int s = 0; s < W; ++s) {
      const HeadSlot* head = layout.dispatch_head(comm.signals(me), gen, s);
      comm.wait_at_least(&head->gen, gen, kOpDispatch, s);
      counts[s] = int32_t(head->nrows);
      src_tokens[s] = int32_t(head->ntok);
      nchunks[s] = s == me ? 0 : ep_chunks(head->ntok, head->chunk_tokens);  // own rows are in place already
      offset[s + 1] = offset[s] + head->nrows;
    }
    const int64_t rounds = *std::max_element(nchunks.begin(), nchunks.end());
    for (int64_t c = 0; c < rounds; ++c) {
      for (int s = 0; s < W; ++s) {
        if (c >= nchunks[s]) continue;
        const ChunkSlot* slot = layout.dispatch_chunk(comm.signals(me), gen, s, c);
        comm.wait_at_least(&slot->gen, gen, kOpDispatch, s);
        for (uint32_t j = slot->row_start; j < slot->row_start + slot->nrows; ++j) take_row(s, j, offset[s] + j);
      }
    }
    return offset[W];
  }

  // Row j of source s in this rank's heap, into output row o.
  void take_row(int s, uint32_t j, int64_t o) {
    char* row = layout.dispatch_row(comm.data(me), gen, s, j);
    std::memcpy(rx + o * payload, row, size_t(payload));
    if (S) std::memcpy(scales_out + o * S, layout.row_scales(row), size_t(S) * 4);
    const int32_t* row_ids = layout.row_ids(row);
    const float* row_weights = layout.row_weights(row);
    for (int64_t k = 0; k < K; ++k) rid_out[o * K + k] = IdxT(row_ids[k]);
    if (rw_out)
      for (int64_t k = 0; k < K; ++k) rw_out[o * K + k] = WT(row_weights[k]);
    src_out[o] = int32_t(s * cap + *layout.row_token(row));
  }

  // Padding rows, from `received` on: x is left unwritten (the contract
  // leaves it unspecified), the routing says "nowhere".
  void mark_padding(int64_t received) {
    const int64_t rows = int64_t(W) * cap;
    std::fill(rid_out + received * K, rid_out + rows * K, IdxT(-1));
    if (rw_out) std::fill(rw_out + received * K, rw_out + rows * K, WT(0));
    std::fill(src_out + received, src_out + rows, -1);
  }

  // Token t's row, and an FP8 row's scales, as they travel: x's bytes (a
  // pair's with its scales), or FP8 quantised here from x in dtype (the
  // last token's quantised row is kept for its other peers).
  void put_row(int64_t t, char* row, float* scales) {
    const char* src = xp + t * in_row;
    const float* src_scales = x_scales ? x_scales + t * S : nullptr;
    if (!quantised.empty()) {
      if (quantised_token != t) quantize_fp8_row(x_dtype, src, H, quantised.data(), quantised_scales.data());
      quantised_token = t;
      src = quantised.data();
      src_scales = quantised_scales.data();
    }
    std::memcpy(row, src, size_t(payload));
    if (S) std::memcpy(scales, src_scales, size_t(S) * 4);
  }

  // Token t's routing as destination d sees it: the local id where the
  // slot's expert lives on d, else -1 and weight 0 (the heap row holds
  // int32 ids and fp32 weights; the own rows take the caller's dtypes).
  template <typename OutId, typename OutW>
  void put_routing(int64_t t, int d, OutId* rid, OutW* rw) const {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = int64_t(ids[t * K + k]);
      const bool here = expert_owner(e, comm.cfg_.num_experts, epr, W) == d;
      rid[k] = OutId(here ? e - d * epr : -1);
      if (rw) rw[k] = OutW(here && weights ? float(weights[t * K + k]) : 0.f);
    }
  }

  CpuComm& comm;
  const Layout& layout;
  const int W, me;
  const int64_t T, K, cap, epr, H, S;
  const int64_t in_row, payload;  // bytes of an input row and of an output row (FP8: one per channel)
  const int64_t C, nch;           // the chunking: nch chunks of C tokens, the last one shorter
  const at::ScalarType x_dtype;
  const char* const xp;
  const float* const x_scales;  // a pair's scales; nullptr when x is not a pair, or T = 0
  const IdxT* const ids;
  const WT* const weights;  // nullptr without weights
  Dispatched& out;
  int32_t* const mask_out;
  char* const rx;
  float* const scales_out;
  IdxT* const rid_out;
  WT* const rw_out;
  int32_t* const src_out;
  std::vector<char> quantised;  // FP8 from x in dtype: the row last quantised, and its scales
  std::vector<float> quantised_scales;
  int64_t quantised_token = -1;
  std::vector<uint32_t> start;
  uint64_t gen = 0;
};

void CpuComm::dispatch_impl(const at::Tensor& x, const c10::optional<at::Tensor>& x_scales, const at::Tensor& topk_idx,
                            const c10::optional<at::Tensor>& topk_weights, Dispatched& out) {
  const float* scales = x_scales ? x_scales->data_ptr<float>() : nullptr;  // nullptr when T = 0
  const bool pair = x_scales.has_value();
  AT_DISPATCH_INDEX_TYPES(topk_idx.scalar_type(), "rdna4_comm_dispatch_ids", [&] {
    using IdxT = index_t;
    if (!topk_weights) return Dispatch<IdxT, float>(*this, x, pair, scales, topk_idx.data_ptr<IdxT>(), nullptr, out).run();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, topk_weights->scalar_type(),
                                    "rdna4_comm_dispatch_weights", [&] {
      Dispatch<IdxT, scalar_t>(*this, x, pair, scales, topk_idx.data_ptr<IdxT>(), topk_weights->data_ptr<scalar_t>(),
                               out)
          .run();
    });
  });
}

// combine, as the GPU's blocks run it: every row received from a peer goes
// back to that peer's inbox, chunk by chunk of the peer's tokens, each
// (destination, chunk) flagged, empty chunks included; this rank's own
// contributions are read straight from y. All flags are published before
// the first wait.
void CpuComm::combine_impl(const at::Tensor& y, const at::Tensor& recv_src, const at::Tensor& counts,
                           const at::Tensor& src_tokens, const at::Tensor& send_mask, const at::Tensor& dispatch_round,
                           at::Tensor& out) {
  const int W = cfg_.world, me = cfg_.rank;
  const int64_t cap = cfg_.cap, H = cfg_.hidden, T = send_mask.size(0);
  const int64_t payload = H * int64_t(c10::elementSize(cfg_.dtype));
  const int32_t* src = recv_src.data_ptr<int32_t>();
  const int32_t* cnt = counts.data_ptr<int32_t>();
  const int32_t* ntok = src_tokens.data_ptr<int32_t>();
  const int32_t* mask = send_mask.data_ptr<int32_t>();
  const char* yp = static_cast<const char*>(y.data_ptr());
  check_handle_values(src, cnt, ntok, mask, T);
  const uint64_t gen =
      begin_round(kOpCombine, combine_call(call_flags(call_) & 1, uint64_t(*dispatch_round.data_ptr<int64_t>())));
  std::vector<int64_t> offset(W + 1, 0);
  for (int s = 0; s < W; ++s) offset[s + 1] = offset[s] + cnt[s];

  // Send: source s's rows lie in token order, so chunk c of its tokens is
  // the next run of rows.
  for (int s = 0; s < W; ++s) {
    if (s == me) continue;
    const int64_t Cs = ep_chunk_tokens(ntok[s]), base = int64_t(s) * cap;
    int64_t j = offset[s];
    for (int64_t c = 0; c < ep_num_chunks(ntok[s]); ++c) {
      for (; j < offset[s + 1] && src[j] - base < (c + 1) * Cs; ++j)
        std::memcpy(layout_.combine_row(data(s), gen, me, src[j] - base), yp + j * payload, size_t(payload));
      store_release(layout_.combine_flag(signals(s), gen, me, c), gen);
    }
  }

  // Receive: the row of y that holds this rank's own contribution to each
  // token (row 0 until mapped, as on the GPU: a handle whose send_mask and
  // recv_src disagree reads a wrong row of y, never memory outside it).
  std::vector<int64_t> own_row(size_t(T), 0);
  for (int64_t j = offset[me]; j < offset[me + 1]; ++j) own_row[size_t(src[j] - int64_t(me) * cap)] = j;
  const int64_t C = ep_chunk_tokens(T);
  char* o = static_cast<char*>(out.data_ptr());
  std::vector<const char*> parts;
  for (int64_t c = 0; c < ep_num_chunks(T); ++c) {
    for (int r = 0; r < W; ++r)
      if (r != me) wait_at_least(layout_.combine_flag(signals(me), gen, r, c), gen, kOpCombine, r);
    for (int64_t t = c * C; t < std::min((c + 1) * C, T); ++t) {
      parts.clear();
      for (int r = 0; r < W; ++r) {
        if (!(uint32_t(mask[t]) >> r & 1u)) continue;
        parts.push_back(r == me ? yp + own_row[size_t(t)] * payload : layout_.combine_row(data(me), gen, r, t));
      }
      if (parts.empty())
        std::memset(o + t * payload, 0, size_t(payload));
      else
        sum_in_order(cfg_.dtype, o + t * payload, parts, H);
    }
  }
  finish_op(kOpCombine, gen);
}

}  // namespace cpu
}  // namespace rdna4_comm
