// Function qualifiers, defined once for every compiler that reads the
// sources: RC_HD for code that host, device and the CPU transport share
// (protocol.h), RC_DEVICE for device-only helpers. Both are inline, so a
// header's functions may appear in every translation unit that includes it.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)
#define RC_HD __host__ __device__ inline
#define RC_DEVICE __device__ __forceinline__
#else
#define RC_HD inline
#endif
