"""Builds rdna4_comm._C.

The backend follows the installed torch:
  * CPU build of torch        -> CppExtension (CPU shared-memory and torch.distributed transports)
  * CUDA build with a toolkit -> CUDAExtension (adds the GPU transport)
  * ROCm build (torch.version.hip) -> CUDAExtension, hipified by torch; kernels
    for PYTORCH_ROCM_ARCH (default gfx1201)
RDNA4_COMM_BACKEND=cpu|cuda|rocm forces the choice (e.g. a GPU-less build host).
"""
import glob
import os

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

# Built in every build (gpu_transport.cpp: the GPU transport's record, which
# exists without GPU support too).
CPU_SOURCES = ["csrc/bindings.cpp", "csrc/ops.cpp", "csrc/eager.cpp", "csrc/transport.cpp", "csrc/comm.cpp",
               "csrc/call_words.cpp", "csrc/peer_processes.cpp", "csrc/ep_layouts.cpp", "csrc/handle_checks.cpp",
               "csrc/cpu/cpu_comm.cpp", "csrc/cpu/cpu_ep.cpp", "csrc/torch_dist/dist_comm.cpp",
               "csrc/gpu/gpu_transport.cpp"]
# One .cu per op family (all_reduce.cu, all_reduce_rmsnorm.cu, dispatch.cu, combine.cu, expert_layout.cu,
# expert_sum.cu, probe.cu).
GPU_SOURCES = ["csrc/gpu/gpu_comm.cpp", "csrc/gpu/runtime.cpp"] + sorted(glob.glob("csrc/gpu/*.cu"))


def select_backend() -> str:
    forced = os.environ.get("RDNA4_COMM_BACKEND", "").strip().lower()
    if forced:
        if forced not in ("cpu", "cuda", "rocm"):
            raise SystemExit(f"RDNA4_COMM_BACKEND must be cpu, cuda or rocm, got {forced!r}")
        return forced
    if torch.version.hip:
        return "rocm"
    if torch.version.cuda and CUDA_HOME:
        return "cuda"
    return "cpu"


def extension():
    backend = select_backend()
    # -g0: Python's CFLAGS carry -g, and debug info for torch's headers
    # nearly doubles each file's compile time.
    cxx = ["-O3", "-g0"]
    if backend == "cpu":
        print("rdna4_comm: building the CPU backend")
        return CppExtension("rdna4_comm._C", CPU_SOURCES, extra_compile_args={"cxx": cxx})
    if backend == "rocm":
        os.environ.setdefault("PYTORCH_ROCM_ARCH", "gfx1201")
        print(f"rdna4_comm: building the ROCm backend for {os.environ['PYTORCH_ROCM_ARCH']}")
        gpu_flags = ["-O3"]
    else:
        print(f"rdna4_comm: building the CUDA backend (TORCH_CUDA_ARCH_LIST="
              f"{os.environ.get('TORCH_CUDA_ARCH_LIST', 'torch default')})")
        # No fast-math: sums must round exactly as the reference does.
        gpu_flags = ["-O3", "-lineinfo"]
    return CUDAExtension(
        "rdna4_comm._C",
        CPU_SOURCES + GPU_SOURCES,
        define_macros=[("RDNA4_COMM_WITH_GPU", "1")],
        extra_compile_args={"cxx": cxx, "nvcc": gpu_flags},
    )


setup(
    name="rdna4_comm",
    version="0.1.0",
    description="Direct peer-to-peer MoE dispatch/combine and all_reduce ops for PyTorch",
    packages=find_packages(include=["rdna4_comm", "rdna4_comm.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
    # rdna4_comm.integrations.transformers, tested with transformers 5.18.0,
    # 5.19.0 and 5.24.0: 5.18 is the first whose experts modules skip the id num_experts
    # (experts of other ranks) in their eager and grouped_mm forwards.
    extras_require={"transformers": ["transformers>=5.18"]},
    entry_points={
        "console_scripts": ["rdna4-comm-doctor=rdna4_comm.doctor:main"],
        # vLLM loads it in every process; it acts only where VLLM_PLUGINS names it.
        "vllm.general_plugins": ["rdna4_comm = rdna4_comm.integrations.vllm:register"],
    },
    zip_safe=False,
)
