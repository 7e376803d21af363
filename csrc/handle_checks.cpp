// Bad handles: the one checker of a handle's values on the host, and the one
// table of what each value must be, whose texts the GPU kernel's error word
// (device_bad_handle_message) shares (docs/semantics.md, "Bad handles").
#include "comm.h"

#include <c10/util/Exception.h>

#include <sstream>

#include "error_words.h"

namespace rdna4_comm {

std::string Comm::bad_handle_message(int field, int64_t index, int64_t value, const std::string& expected) {
  std::ostringstream s;
  s << "combine: " << handle_field_name(field) << "[" << index << "] = " << value
    << " is out of range: expected " << expected
    << ". The handle is not the Dispatched.handle of this communicator's matching dispatch";
  return s.str();
}

std::string Comm::handle_expectation(int field, int64_t index, const HandleFacts& f) const {
  const int64_t cap = cfg_.cap;
  std::ostringstream e;
  switch (field) {
    case kHandleRecvSrc:
      if (f.previous >= 0)
        e << "greater than handle.recv_src[" << f.previous << "] = " << f.previous_value
          << " (a source's rows ascend by token)";
      else if (f.source >= 0)
        e << "a row of source rank " << f.source << ", " << f.source << " * " << cap << " + t with t below "
          << f.source_tokens << " (the source rank " << f.source << "'s token count): in [" << f.source * cap
          << ", " << f.source * cap + f.source_tokens << ")";
      else
        e << "for a received row (below handle.counts.sum()) s * " << cap
          << " + t, s its source rank and t below that rank's token count (handle.src_tokens[s]), "
             "greater than the row before it from the same source (a source's rows ascend by token)";
      break;
    case kHandleCounts: e << "a row count in [0, " << cap << "] (max_tokens_per_rank)"; break;
    case kHandleSrcTokens:
      if (f.tokens >= 0) {
        e << f.tokens << ", this rank's token count (the length of handle.send_mask)";
      } else {
        e << "a token count in [0, " << cap << "] (max_tokens_per_rank)";
        if (!f.host && index == cfg_.rank) e << ", for this rank the length of handle.send_mask";
      }
      break;
    default:
      e << "a set of ranks below the world size " << cfg_.world << ", in [0, " << ((int64_t(1) << cfg_.world) - 1)
        << "]";
  }
  return e.str();
}

void Comm::check_handle_values(const int32_t* recv_src, const int32_t* counts, const int32_t* src_tokens,
                               const int32_t* send_mask, int64_t ntok) const {
  const int W = cfg_.world, me = cfg_.rank;
  const int64_t cap = cfg_.cap;
  auto fail = [&](int field, int64_t index, int64_t value, HandleFacts facts) {
    facts.host = true;
    TORCH_CHECK_VALUE(false, bad_handle_message(field, index, value, handle_expectation(field, index, facts)));
  };
  for (int s = 0; s < W; ++s) {
    if (counts[s] < 0 || counts[s] > cap) fail(kHandleCounts, s, counts[s], {});
    if (src_tokens[s] < 0 || src_tokens[s] > cap) fail(kHandleSrcTokens, s, src_tokens[s], {});
  }
  if (src_tokens[me] != ntok) {
    HandleFacts f;
    f.tokens = ntok;
    fail(kHandleSrcTokens, me, src_tokens[me], f);
  }
  const uint32_t ranks = uint32_t((uint64_t(1) << W) - 1);
  for (int64_t t = 0; t < ntok; ++t)
    if (uint32_t(send_mask[t]) & ~ranks) fail(kHandleSendMask, t, send_mask[t], {});
  int64_t j = 0;
  for (int s = 0; s < W; ++s) {
    const int64_t first = s * cap, end = first + src_tokens[s];
    for (int32_t k = 0; k < counts[s]; ++k, ++j) {
      if (recv_src[j] < first || recv_src[j] >= end) {
        HandleFacts f;
        f.source = s;
        f.source_tokens = src_tokens[s];
        fail(kHandleRecvSrc, j, recv_src[j], f);
      }
      // Chunks of a source's tokens are runs of its rows: out of order, a
      // row would travel with another chunk than its flag announces.
      if (k > 0 && recv_src[j] <= recv_src[j - 1]) {
        HandleFacts f;
        f.previous = j - 1;
        f.previous_value = recv_src[j - 1];
        fail(kHandleRecvSrc, j, recv_src[j], f);
      }
    }
  }
  // recv_src past the received rows is never read, so any value passes.
}

std::string Comm::bad_handle_failure(const std::string& message, const char* found) const {
  std::ostringstream s;
  s << "rdna4_comm: " << message << " (found on rank " << cfg_.rank << " of communicator '" << cfg_.id << "' "
    << found << "). The communicator is unusable now: close it and create a new one.";
  return s.str();
}

std::string Comm::device_bad_handle_message(uint64_t word) const {
  const int field = bad_handle_field(word);
  const int64_t index = bad_handle_index(word);
  const std::string expected = handle_expectation(field, index, HandleFacts{});
  return bad_handle_failure(bad_handle_message(field, index, bad_handle_value(word), expected),
                            "by the combine kernel, which stored nothing out of bounds");
}

}  // namespace rdna4_comm
