#!/usr/bin/env bash
# Device run for branch wip/next, second call (after run8a.sh, on the same
# machine: the build is kept): the expert-layout and EP GPU tests with ranks
# sharing the GPU, the sanitizers, then the rest of the suite in the time left.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0
RES=$OUT; export OUT=/tmp/o; mkdir -p $OUT
trap 'tar czf $RES/run.tgz -C /tmp o' EXIT
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
RDNA4_COMM_ALLOW_SHARED_GPU=1 RDNA4_COMM_TEST_JOBS=12 timeout 300 bash scripts/gpu_check.sh \
  --timeout 150 -rfE tests/test_expert_layout.py tests/test_ep.py tests/test_fp8_dispatch.py tests/test_fp8.py \
  tests/test_moe.py tests/test_policy.py > $OUT/tests_ep.txt 2>&1
echo "tests_ep rc=$? at $(el) s"; grep -v "Warning\|warner" $OUT/tests_ep.txt | tail -12 | cut -c1-200
RDNA4_COMM_SKIP_BUILD=1 timeout 100 bash scripts/gpu_sanitize.sh > $OUT/sanitize.txt 2>&1; echo "sanitize rc=$? at $(el) s"
grep -E "exit|SUMMARY|planted" $OUT/sanitize.txt | cut -c1-120
left=$(( ${DEADLINE:-570} - $(el) ))
RDNA4_COMM_ALLOW_SHARED_GPU=1 RDNA4_COMM_TEST_JOBS=14 RDNA4_COMM_TEST_EXAMPLES=0.15 timeout $left bash scripts/gpu_check.sh \
  --timeout 150 -rfE --ignore=tests/test_vllm.py --ignore=tests/test_vllm_plugin.py --ignore=tests/test_hip_compile.py \
  --ignore=tests/test_cuda_compile.py --ignore=tests/test_readme.py --ignore=tests/test_benchmarks.py \
  --ignore=tests/test_expert_layout.py --ignore=tests/test_ep.py --ignore=tests/test_fp8_dispatch.py \
  --ignore=tests/test_fp8.py --ignore=tests/test_moe.py --ignore=tests/test_policy.py > $OUT/tests_rest.txt 2>&1
echo "tests_rest rc=$? at $(el) s"; grep -v "Warning\|warner" $OUT/tests_rest.txt | tail -12 | cut -c1-200
