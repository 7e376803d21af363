#!/usr/bin/env bash
# Branch head: build; ep_kernel_times; sanitizers; the GPU suite (shared ranks, fewer hypothesis examples).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0
RES=$OUT; export OUT=/tmp/o; mkdir -p $OUT
trap 'tar czf $RES/run.tgz -C /tmp o' EXIT
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
MAX_JOBS=16 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1; echo "build rc=$? at $(el) s"
PYTHONPATH=$PWD timeout 40 python3 benchmarks/ep_kernel_times.py --alignment 1 > $OUT/ekt.txt 2>&1; echo "ekt rc=$? at $(el) s"
grep -E "per step|place|combine_kernel" $OUT/ekt.txt | cut -c1-100
RDNA4_COMM_SKIP_BUILD=1 timeout 120 bash scripts/gpu_sanitize.sh > $OUT/sanitize.txt 2>&1; echo "sanitize rc=$? at $(el) s"
grep -E "exit|SUMMARY|planted" $OUT/sanitize.txt | cut -c1-120
left=$(( ${DEADLINE:-575} - $(el) ))
RDNA4_COMM_ALLOW_SHARED_GPU=1 RDNA4_COMM_TEST_JOBS=14 RDNA4_COMM_TEST_EXAMPLES=${EXAMPLES:-0.15} timeout $left bash scripts/gpu_check.sh \
  --timeout 150 -rfE --durations=12 --ignore=tests/test_vllm.py --ignore=tests/test_vllm_plugin.py --ignore=tests/test_hip_compile.py \
  --ignore=tests/test_cuda_compile.py --ignore=tests/test_readme.py --ignore=tests/test_benchmarks.py > $OUT/tests.txt 2>&1
echo "tests rc=$? at $(el) s"; grep -v "Warning\|warner" $OUT/tests.txt | tail -40 | cut -c1-200
