// The GPU transport's record (transport.h), in every build: its gates and
// limits hold where this build has no GPU support too, for callers who plan
// for it; creating it then raises.
#include <c10/util/Exception.h>

#include "../bounds.h"
#include "../comm.h"

namespace rdna4_comm {
namespace {

#ifdef RDNA4_COMM_WITH_GPU
constexpr bool kBuilt = true;
std::shared_ptr<Comm> make(CommConfig cfg) { return make_gpu_comm(std::move(cfg)); }
#else
constexpr bool kBuilt = false;
std::shared_ptr<Comm> make(CommConfig) {
  TORCH_CHECK(false, "rdna4_comm was built without GPU support (torch had no CUDA/ROCm when it was built); use "
                     "transport=\"cpu\" or rebuild against a GPU build of torch (README.md, \"Building for GPUs\")");
}
#endif

// The kernels' per-destination state in shared memory bounds the world,
// and their 32-bit row indices cap (bounds.h).
RDNA4_COMM_REGISTER_TRANSPORT("gpu", kBuilt, /*device_kernels=*/true, /*writes_cross_links=*/true,
                              /*process_group=*/false, /*device_tensors=*/true, /*graph_capture=*/true, kMaxGpuWorld,
                              kMaxGpuTokensPerRank, /*default_slot_bytes=*/int64_t(16) << 20, make);

}  // namespace
}  // namespace rdna4_comm
