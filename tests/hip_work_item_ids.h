// The four work-item functions of ROCm's device library (ockl) that HIP's
// threadIdx, blockIdx, blockDim and gridDim call, for
// tests/test_hip_compile.py. Its compiles take -nogpulib (Debian's builds
// of the library are too old for gfx1201 or built for a newer LLVM than
// the check's clang-19), so without these each read of threadIdx is an
// external call, which clobbers registers: the check's VGPR and scratch
// figures would then be those of a build that no ROCm install makes. A ROCm
// build links the library and inlines them to the same builtins and
// implicit-argument loads (code object v5: block counts at byte 0, group
// sizes at 12, remainders at 18). Force-included ahead of each source: HIP's
// headers declare the four later, and these definitions serve them.
#pragma once

namespace rdna4_comm_hip_check {
struct ImplicitArgs {
  uint32_t block_count[3];
  uint16_t group_size[3];
  uint16_t remainder[3];
};
__device__ __attribute__((always_inline)) inline const ImplicitArgs* implicit_args() {
  return reinterpret_cast<const ImplicitArgs*>(__builtin_amdgcn_implicitarg_ptr());
}
}  // namespace rdna4_comm_hip_check

extern "C" __device__ __attribute__((always_inline)) size_t __ockl_get_local_id(unsigned int dim) {
  return dim == 0 ? __builtin_amdgcn_workitem_id_x()
                  : (dim == 1 ? __builtin_amdgcn_workitem_id_y() : __builtin_amdgcn_workitem_id_z());
}

extern "C" __device__ __attribute__((always_inline)) size_t __ockl_get_group_id(unsigned int dim) {
  return dim == 0 ? __builtin_amdgcn_workgroup_id_x()
                  : (dim == 1 ? __builtin_amdgcn_workgroup_id_y() : __builtin_amdgcn_workgroup_id_z());
}

// The last group along a dimension may be partial: its size is the remainder.
extern "C" __device__ __attribute__((always_inline)) size_t __ockl_get_local_size(unsigned int dim) {
  const rdna4_comm_hip_check::ImplicitArgs* a = rdna4_comm_hip_check::implicit_args();
  return __ockl_get_group_id(dim) < a->block_count[dim] ? a->group_size[dim] : a->remainder[dim];
}

extern "C" __device__ __attribute__((always_inline)) size_t __ockl_get_num_groups(unsigned int dim) {
  const rdna4_comm_hip_check::ImplicitArgs* a = rdna4_comm_hip_check::implicit_args();
  return a->block_count[dim] + (a->remainder[dim] != 0 ? 1u : 0u);
}
