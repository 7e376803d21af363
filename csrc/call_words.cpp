// The call words (calls.h) on the host: the word of an all_reduce dtype,
// and what a word says in the texts that report ranks whose calls differ.
#include "comm.h"

#include <sstream>

#include "calls.h"

namespace rdna4_comm {

namespace {
std::string call_dtype_name(int dtype) {
  return dtype == kCallF32 ? "torch.float32" : dtype == kCallBF16 ? "torch.bfloat16" : "torch.float16";
}
int64_t rmsnorm_hidden(uint64_t word) { return int64_t(call_value(word) & uint64_t(kCallMaxHidden)); }
int64_t rmsnorm_rows(uint64_t word) { return int64_t(call_value(word) >> kCallHiddenBits); }
const char* layout_name(uint64_t word) { return call_flags(word) & 1 ? "\"expert\"" : "\"rank\""; }
}  // namespace

int call_dtype_of(at::ScalarType st) {
  return st == at::kFloat ? kCallF32 : st == at::kBFloat16 ? kCallBF16 : kCallF16;
}

std::string Comm::call_name(uint64_t word) {
  std::ostringstream s;
  switch (call_op(word)) {
    case kCallAllReduce:
      s << "all_reduce(dtype=" << call_dtype_name(call_dtype(word)) << ", numel=" << call_value(word) << ")";
      break;
    case kCallAllReduceRmsNorm:
      s << "all_reduce_rmsnorm(dtype=" << call_dtype_name(call_dtype(word)) << ", hidden=" << rmsnorm_hidden(word)
        << ", rows=" << rmsnorm_rows(word) << ", residual=" << (call_flags(word) & 1 ? "given" : "None") << ")";
      break;
    case kCallDispatch:
      s << "dispatch(layout=" << layout_name(word) << (call_flags(word) & 2 ? ", x=a (q, scales) pair" : "") << ")";
      break;
    case kCallCombine:
      s << "combine(the handle of the dispatch of round " << call_value(word) << ", layout=" << layout_name(word)
        << ")";
      break;
    default:
      s << "no call";
  }
  return s.str();
}

void Comm::raise_mismatch(uint64_t round, uint64_t mine, int peer, uint64_t theirs) {
  failure_ = mismatch_message(round, mine, peer, theirs);
  TORCH_CHECK_VALUE(false, failure_);
}

std::string Comm::mismatch_message(uint64_t round, uint64_t mine, int peer, uint64_t theirs) const {
  const std::string there = " on rank " + std::to_string(peer);
  std::vector<std::string> differ;
  auto field = [&](const char* name, auto a, auto b) {
    if (a != b) differ.push_back(std::string(name) + " " + std::to_string(a) + " here, " + std::to_string(b) + there);
  };
  const int flags = call_flags(mine) ^ call_flags(theirs);
  if (call_op(mine) != call_op(theirs)) {
    differ.push_back("a different op: a rank skipped a call, or made one its peers did not");
  } else {
    if (call_dtype(mine) != call_dtype(theirs))
      differ.push_back("dtype " + call_dtype_name(call_dtype(mine)) + " here, " + call_dtype_name(call_dtype(theirs)) +
                       there);
    switch (call_op(mine)) {
      case kCallAllReduce:
        field("numel", call_value(mine), call_value(theirs));
        break;
      case kCallAllReduceRmsNorm:
        field("hidden", rmsnorm_hidden(mine), rmsnorm_hidden(theirs));
        field("rows", rmsnorm_rows(mine), rmsnorm_rows(theirs));
        if (flags & 1) differ.push_back("a residual given on one rank only");
        break;
      case kCallDispatch:
        if (flags & 1) differ.push_back(std::string("layout ") + layout_name(mine) + " here, " + layout_name(theirs) + there);
        if (flags & 2) differ.push_back("x a (q, scales) pair on one rank only");
        break;
      case kCallCombine:
        if (call_value(mine) != call_value(theirs))
          differ.push_back("handles of different dispatches: of round " + std::to_string(call_value(mine)) +
                           " here, of round " + std::to_string(call_value(theirs)) + there);
        if (flags & 1) differ.push_back("an expert-layout handle on one rank only");
        break;
    }
  }
  std::ostringstream s;
  s << "rdna4_comm: the ranks of communicator '" << cfg_.id << "' disagree on round " << round << ": rank "
    << cfg_.rank << " called " << call_name(mine) << ", rank " << peer << " called " << call_name(theirs) << " (";
  for (size_t i = 0; i < differ.size(); ++i) s << (i ? "; " : "") << differ[i];
  s << "). No rank gets a result of this call. The communicator is unusable now: close it; a new Communicator "
       "on the same group works (docs/semantics.md, \"Calls that disagree\").";
  return s.str();
}

}  // namespace rdna4_comm
