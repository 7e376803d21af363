// The testing extension: kernels and hooks only the tests use, in a module
// of their own that the tests build from these sources and
// csrc/gpu/runtime.cpp (tests/gpu_testing.py), so that the installed
// library carries none of them.
#include <torch/python.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstring>

#include "../gpu/export_record.h"
#include "../gpu/runtime.h"
#include "testing.h"

namespace rdna4_comm {
namespace {

using namespace gpu;

void check(Error e, const char* call) {
  TORCH_CHECK(e == kSuccess, "rdna4_comm testing: ", call, " failed: ", error_string(e));
}

Stream current_stream(int device_index) { return c10::cuda::getCurrentCUDAStream(device_index).stream(); }

void occupy_gpu(int device_index, double fraction, int64_t ms) {
  c10::cuda::CUDAGuard guard(device_index);
  int sms = 0;
  uint64_t ticks_per_ms = 0;
  check(multiprocessor_count(&sms, device_index), "multiprocessor_count");
  check(timer_ticks_per_ms(&ticks_per_ms, device_index), "timer_ticks_per_ms");
  const int blocks = std::max(1, int(fraction * occupy_blocks_per_sm() * sms));
  launch_occupy(blocks, uint64_t(ms) * ticks_per_ms, current_stream(device_index));
  check(get_last_error(), "launch_occupy");
}

void store_out_of_bounds(int device_index) {
  c10::cuda::CUDAGuard guard(device_index);
  constexpr int64_t kInts = 64;
  void* p = nullptr;
  check(malloc_data(&p, kInts * sizeof(int32_t)), "malloc_data");
  launch_store_out_of_bounds(static_cast<int32_t*>(p), kInts, current_stream(device_index));
  check(get_last_error(), "launch_store_out_of_bounds");
  check(device_synchronize(), "device_synchronize");
  check(free_device(p), "free_device");
}

std::pair<int64_t, int64_t> fp8_conversion_mismatches(int device_index) {
  c10::cuda::CUDAGuard guard(device_index);
  int sms = 0;
  check(multiprocessor_count(&sms, device_index), "multiprocessor_count");
  struct Result {
    unsigned long long count;
    uint32_t first;
  } host{};
  void* p = nullptr;
  check(malloc_data(&p, sizeof(Result)), "malloc_data");
  auto* dev = static_cast<Result*>(p);
  check(memset_device(&dev->count, 0, sizeof(dev->count)), "memset_device");
  check(memset_device(&dev->first, 0xff, sizeof(dev->first)), "memset_device");
  launch_fp8_conversion_check(&dev->count, &dev->first, 8 * sms, current_stream(device_index));
  check(get_last_error(), "launch_fp8_conversion_check");
  check(device_synchronize(), "device_synchronize");
  check(memcpy_to_host(&host, dev, sizeof(Result)), "memcpy_to_host");
  check(free_device(p), "free_device");
  return {int64_t(host.count), int64_t(host.first)};
}

// The spares stay allocated until the process exits: a heap this process
// allocates later could otherwise be a spare's memory, holding the pattern
// a peer wrote there, and pass the probe it should fail.
py::bytes with_spare_data(const std::string& record, int device_index, int64_t data_bytes) {
  TORCH_CHECK_VALUE(record.size() == sizeof(ExportRecord), "with_spare_data: not a GPU heap record");
  c10::cuda::CUDAGuard guard(device_index);
  ExportRecord rec;
  std::memcpy(&rec, record.data(), sizeof(rec));
  void* spare = nullptr;
  check(malloc_data(&spare, size_t(data_bytes)), "malloc_data");
  check(ipc_get_handle(&rec.data, spare), "ipc_get_handle");
  return py::bytes(reinterpret_cast<const char*>(&rec), sizeof(rec));
}

}  // namespace
}  // namespace rdna4_comm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace rdna4_comm;
  m.def("occupy_gpu", &occupy_gpu, py::arg("device"), py::arg("fraction"), py::arg("ms"),
        "Keep `fraction` of the GPU's thread slots spinning for `ms` ms, on the current stream");
  m.def("store_out_of_bounds", &store_out_of_bounds, py::arg("device"),
        "One store just past the end of a fresh 256-byte allocation (for compute-sanitizer)");
  m.def("fp8_conversion_mismatches", &fp8_conversion_mismatches, py::arg("device"),
        "(count, lowest) of the fp32 patterns whose FP8 byte from the kernels differs from fp8.h's "
        "(two NaNs match; lowest 0xffffffff when none)");
  m.def("with_spare_data", &with_spare_data, py::arg("record"), py::arg("device"), py::arg("data_bytes"),
        "A GPU heap record (what a rank of the GPU transport publishes) with its data handle replaced by that "
        "of a spare allocation of `data_bytes` on `device`: the peers then write their data there, their "
        "flags still into the rank's signal memory");
}
