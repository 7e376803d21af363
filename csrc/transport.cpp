#include "transport.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <sstream>

#include "policies.h"

namespace rdna4_comm {
namespace {
// Records never move once added (find_transport hands out references).
std::deque<Transport>& registry() {
  static std::deque<Transport> r;
  return r;
}
}  // namespace

bool register_transport(const Transport& t) {
  for (const Transport& known : registry()) TORCH_INTERNAL_ASSERT(std::string(known.name) != t.name, t.name);
  registry().push_back(t);
  return true;
}

const Transport& find_transport(const std::string& name) {
  for (const Transport& t : registry())
    if (name == t.name) return t;
  std::ostringstream known;
  for (const Transport* t : transports()) known << (known.tellp() > 0 ? ", " : "") << "'" << t->name << "'";
  TORCH_CHECK_VALUE(false, "rdna4_comm: no transport named '", name, "' (there are ", known.str(), ")");
}

// By name: the registration order is the link order of their files.
std::vector<const Transport*> transports() {
  std::vector<const Transport*> out;
  for (const Transport& t : registry()) out.push_back(&t);
  std::sort(out.begin(), out.end(), [](const Transport* a, const Transport* b) { return std::strcmp(a->name, b->name) < 0; });
  return out;
}

int64_t one_shot_max_bytes(const Transport& t) { return allreduce_one_shot_max_bytes(t.device_kernels); }

}  // namespace rdna4_comm
