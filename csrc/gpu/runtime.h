// The GPU transport's calls into the CUDA/HIP runtime (memory, IPC, peer
// access, events, device attributes), declared torch-free. runtime.cpp is
// the only host file that calls the runtime itself, so the API differences
// between CUDA and HIP on the host side are all there, and CI compiles it
// as HIP host code against ROCm's headers (tests/test_hip_compile.py), which
// gpu_comm.cpp, built on torch's CUDA/HIP stream API, cannot be without a
// ROCm build of torch. Every function returns the runtime's status.
#pragma once

#include <cstddef>
#include <cstdint>

#include "platform.h"

namespace rdna4_comm {
namespace gpu {

using Error = RC_RT(Error_t);
using IpcHandle = RC_RT(IpcMemHandle_t);
using Event = RC_RT(Event_t);
constexpr Error kSuccess = RC_RT(Success);
constexpr Error kPeerAccessAlreadyEnabled = RC_RT(ErrorPeerAccessAlreadyEnabled);

const char* error_string(Error e);
Error get_last_error();
Error device_synchronize();

// Devices: by PCI bus id and back, peer access, and what the launch
// policies and the spin timeouts need.
Error device_by_pci_bus_id(int* device, const char* bus_id);
Error pci_bus_id(char* buf, int len, int device);
Error can_access_peer(int* ok, int device, int peer);
Error enable_peer_access(int peer);
Error multiprocessor_count(int* n, int device);
// Ticks per millisecond of the timer the kernels' spins read (sync.cuh).
Error timer_ticks_per_ms(uint64_t* ticks, int device);

// Memory. Signals: the flags and counters peers write and spins poll.
Error malloc_data(void** p, size_t n);
Error malloc_signals(void** p, size_t n);
Error free_device(void* p);
// Host memory the GPU writes (the error word), and its device address.
Error host_alloc_mapped(void** p, size_t n);
Error free_host(void* p);
Error host_device_pointer(void** device_view, void* host);
Error memset_device(void* p, int value, size_t n);
Error memcpy_to_host(void* dst, const void* src, size_t n);

// Another process's allocation, opened at its base.
Error ipc_get_handle(IpcHandle* h, void* p);
Error ipc_open_handle(void** p, const IpcHandle& h);
Error ipc_close_handle(void* p);

// Stream order across streams and graph replays (GpuComm::in_stream_order).
Error event_create(Event* e);
Error event_destroy(Event e);
Error stream_is_capturing(Stream s, bool* capturing);
// Under capture, `external` makes the record and the wait nodes of the
// graph that act on every launch of it, where plain ones would only be
// dependencies inside the graph (and waiting on an event recorded outside
// the capture would be an error).
Error event_record(Event e, Stream s, bool external);
Error stream_wait_event(Stream s, Event e, bool external);

}  // namespace gpu
}  // namespace rdna4_comm
