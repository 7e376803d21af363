// The transports of this build, each registered where it is defined
// (RDNA4_COMM_REGISTER_TRANSPORT in cpu/cpu_comm.cpp, torch_dist/dist_comm.cpp,
// gpu/gpu_comm.cpp) with a record of what it can do. Code outside a
// transport reads these records; it never compares transport names.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace rdna4_comm {

struct CommConfig;
class Comm;

struct Transport {
  const char* name;  // "cpu", "gpu", "dist": CommConfig::transport, Communicator(transport=...)
  // Whether this build has it (the GPU transport needs a CUDA or ROCm build
  // of torch); a record is registered either way, so its gates and limits
  // answer callers who plan for it (rdna4_comm.allreduce_algorithm).
  bool built;
  // Its ops run rdna4_comm's GPU kernels, whose gates (the one-shot
  // threshold, the fused op's one stage) are tuned apart from the host's.
  bool device_kernels;
  // Peers' parts arrive as their writes across a device link (PCIe,
  // NVLink, XGMI), so a part that never arrives may be a link that drops them.
  bool writes_cross_links;
  // Runs over a torch.distributed group of its own (CommConfig::group_name).
  bool process_group;
  // Takes device tensors where every rank has a GPU.
  bool device_tensors;
  // Its ops on device tensors can be captured in CUDA/HIP graphs.
  bool graph_capture;
  int max_world;
  int64_t max_tokens_per_rank;
  // all_reduce's slot (per parity and source) when none is requested.
  int64_t default_slot_bytes;
  std::shared_ptr<Comm> (*make)(CommConfig cfg);  // raises where the build lacks it
};

// Adds a transport; at load time, from a static initializer (below).
bool register_transport(const Transport& t);
// Raises, naming the transports this build has, for an unknown name.
const Transport& find_transport(const std::string& name);
std::vector<const Transport*> transports();  // by name
// The largest all_reduce that takes the one-shot path on a transport.
int64_t one_shot_max_bytes(const Transport& t);

#define RDNA4_COMM_REGISTER_TRANSPORT(...) \
  const bool transport_registered = ::rdna4_comm::register_transport(::rdna4_comm::Transport{__VA_ARGS__})

}  // namespace rdna4_comm
