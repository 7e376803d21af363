#!/usr/bin/env bash
# The dist transport's empty tensors on CUDA, the README program, the kill test on dist (W = 3).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0
RES=$OUT; export OUT=/tmp/o/gpu; mkdir -p $OUT
trap 'tar czf $RES/run.tgz -C /tmp o' EXIT
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
RDNA4_COMM_ALLOW_SHARED_GPU=1 RDNA4_COMM_TEST_JOBS=8 timeout -s INT $(( ${DEADLINE:-190} - 5 )) \
  bash scripts/gpu_check.sh --timeout 100 -rfE tests/test_faults.py tests/test_readme.py \
  tests/test_allreduce.py::test_empty_tensors_between_others tests/test_fused.py::test_no_rows_between_others > /tmp/o/suite.txt 2>&1
echo "rc=$? at $(el) s"; grep -v "Warning\|warner" /tmp/o/suite.txt | tail -6 | cut -c1-200
grep "^===" $OUT/failures.txt | cut -c1-200
