// runtime.h's functions: the host's only calls into the CUDA/HIP runtime.
// No torch header, so it compiles as HIP host code wherever ROCm's headers
// are (tests/test_hip_compile.py).
#include "runtime.h"

#if defined(RC_HIP) && HIP_VERSION_MAJOR < 6
#error "rdna4_comm's GPU transport needs ROCm 6 or newer (gfx1201 needs ROCm 6.3+)"
#endif

namespace rdna4_comm {
namespace gpu {

const char* error_string(Error e) { return RC_RT(GetErrorString)(e); }
Error get_last_error() { return RC_RT(GetLastError)(); }
Error device_synchronize() { return RC_RT(DeviceSynchronize)(); }

Error device_by_pci_bus_id(int* device, const char* bus_id) { return RC_RT(DeviceGetByPCIBusId)(device, bus_id); }
Error pci_bus_id(char* buf, int len, int device) { return RC_RT(DeviceGetPCIBusId)(buf, len, device); }
Error can_access_peer(int* ok, int device, int peer) { return RC_RT(DeviceCanAccessPeer)(ok, device, peer); }
Error enable_peer_access(int peer) { return RC_RT(DeviceEnablePeerAccess)(peer, 0); }

Error malloc_data(void** p, size_t n) { return RC_RT(Malloc)(p, n); }
Error free_device(void* p) { return RC_RT(Free)(p); }
Error host_device_pointer(void** device_view, void* host) {
  return RC_RT(HostGetDevicePointer)(device_view, host, 0);
}
Error memset_device(void* p, int value, size_t n) { return RC_RT(Memset)(p, value, n); }
Error memcpy_to_host(void* dst, const void* src, size_t n) {
  return RC_RT(Memcpy)(dst, src, n, RC_RT(MemcpyDeviceToHost));
}

Error ipc_get_handle(IpcHandle* h, void* p) { return RC_RT(IpcGetMemHandle)(h, p); }
Error ipc_open_handle(void** p, const IpcHandle& h) {
  return RC_RT(IpcOpenMemHandle)(p, h, RC_RT(IpcMemLazyEnablePeerAccess));
}
Error ipc_close_handle(void* p) { return RC_RT(IpcCloseMemHandle)(p); }

Error event_create(Event* e) { return RC_RT(EventCreateWithFlags)(e, RC_RT(EventDisableTiming)); }
Error event_destroy(Event e) { return RC_RT(EventDestroy)(e); }
Error stream_is_capturing(Stream s, bool* capturing) {
  RC_RT(StreamCaptureStatus) status;
  const Error e = RC_RT(StreamIsCapturing)(s, &status);
  *capturing = status != RC_RT(StreamCaptureStatusNone);
  return e;
}
Error event_record(Event e, Stream s, bool external) {
  return RC_RT(EventRecordWithFlags)(e, s, external ? RC_RT(EventRecordExternal) : RC_RT(EventRecordDefault));
}
Error stream_wait_event(Stream s, Event e, bool external) {
  return RC_RT(StreamWaitEvent)(s, e, external ? RC_RT(EventWaitExternal) : RC_RT(EventWaitDefault));
}

#ifdef RC_HIP
// Flags and counters: uncached, so peer writes are seen without cache
// maintenance and spins poll memory, not a stale line.
Error malloc_signals(void** p, size_t n) { return hipExtMallocWithFlags(p, n, hipDeviceMallocUncached); }
Error host_alloc_mapped(void** p, size_t n) { return hipHostMalloc(p, n, hipHostMallocMapped); }
Error free_host(void* p) { return hipHostFree(p); }
Error multiprocessor_count(int* n, int device) {
  return hipDeviceGetAttribute(n, hipDeviceAttributeMultiprocessorCount, device);
}
// The spins read the steady counter (platform.h, timer_ticks), which runs
// at the wall clock rate the runtime gives in kHz.
Error timer_ticks_per_ms(uint64_t* ticks, int device) {
  int khz = 0;
  const Error e = hipDeviceGetAttribute(&khz, hipDeviceAttributeWallClockRate, device);
  *ticks = uint64_t(khz > 0 ? khz : 100000);
  return e;
}
#else
// NVIDIA keeps peer-written device memory coherent for system-scope
// acquire loads; a plain allocation serves for flags.
Error malloc_signals(void** p, size_t n) { return cudaMalloc(p, n); }
Error host_alloc_mapped(void** p, size_t n) { return cudaHostAlloc(p, n, cudaHostAllocMapped); }
Error free_host(void* p) { return cudaFreeHost(p); }
Error multiprocessor_count(int* n, int device) {
  return cudaDeviceGetAttribute(n, cudaDevAttrMultiProcessorCount, device);
}
// The spins read %globaltimer, which counts nanoseconds.
Error timer_ticks_per_ms(uint64_t* ticks, int) {
  *ticks = 1000000;
  return cudaSuccess;
}
#endif

}  // namespace gpu
}  // namespace rdna4_comm
