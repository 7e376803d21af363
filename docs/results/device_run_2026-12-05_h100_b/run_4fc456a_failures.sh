#!/usr/bin/env bash
# wip/next's GPU test failures, reported as they happen (.devrun/failnow.py):
# the EP set and the rest of the suite side by side, ranks sharing the GPU.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0
RES=$OUT; export OUT=/tmp/o; mkdir -p $OUT
trap 'tar czf $RES/run.tgz -C /tmp o' EXIT
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
export PYTHONPATH=$PWD:$PWD/.devrun FAILNOW=$OUT/fail.txt
MAX_JOBS=16 RDNA4_COMM_SKIP_TESTS=1 bash scripts/gpu_check.sh > $OUT/build.txt 2>&1; echo "build rc=$? at $(el) s"
left=$(( ${DEADLINE:-560} - $(el) ))
EP="tests/test_expert_layout.py tests/test_ep.py tests/test_fp8_dispatch.py tests/test_fp8.py tests/test_moe.py tests/test_policy.py"
(RDNA4_COMM_ALLOW_SHARED_GPU=1 RDNA4_COMM_TEST_JOBS=8 timeout -s INT $left bash scripts/gpu_check.sh -p failnow \
  --timeout 150 -rfE $EP > $OUT/tests_ep.txt 2>&1; echo "tests_ep rc=$? at $(el) s") &
sleep 20; ign=""; for f in $EP tests/test_vllm.py tests/test_vllm_plugin.py tests/test_hip_compile.py tests/test_cuda_compile.py \
  tests/test_readme.py tests/test_benchmarks.py; do ign="$ign --ignore=$f"; done
(RDNA4_COMM_ALLOW_SHARED_GPU=1 RDNA4_COMM_TEST_JOBS=8 RDNA4_COMM_TEST_EXAMPLES=0.15 timeout -s INT $left \
  bash scripts/gpu_check.sh -p failnow --timeout 150 -rfE $ign > $OUT/tests_rest.txt 2>&1; echo "tests_rest rc=$? at $(el) s") &
wait
grep "^===" $OUT/fail.txt
for f in tests_ep tests_rest; do grep -v "Warning\|warner" $OUT/$f.txt | tail -5 | cut -c1-200; done
