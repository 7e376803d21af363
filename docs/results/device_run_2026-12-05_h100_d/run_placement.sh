#!/usr/bin/env bash
# The tree to land: build, bench_kernels, scripts/gpu_sanitize.sh (memcheck,
# racecheck, synccheck, the planted store), then the whole GPU suite with
# ranks sharing the GPU until the deadline (failures in $OUT/gpu/failures.txt
# as they happen).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD
RES=$OUT; export OUT=/tmp/o/gpu; mkdir -p $OUT
trap 'tar czf $RES/run.tgz -C /tmp o' EXIT
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name --format=csv,noheader
MAX_JOBS=16 python3 setup.py build_ext --inplace > /tmp/o/build.log 2>&1; echo "build rc=$? at $(el) s"
PYTHONPATH=$ROOT timeout 120 python3 benchmarks/bench_kernels.py --rounds 3 --calls 30 --out /tmp/o/bk.jsonl > /tmp/o/bk.txt 2>&1
echo "bench rc=$? at $(el) s"; grep -E "^ *[0-9]+  " /tmp/o/bk.txt | cut -c1-118
OUT=/tmp/o/san RDNA4_COMM_SKIP_BUILD=1 timeout 150 bash scripts/gpu_sanitize.sh > /tmp/o/sanitize.txt 2>&1
echo "sanitize rc=$? at $(el) s"; grep -E "exit|SUMMARY|planted" /tmp/o/sanitize.txt | cut -c1-160
RDNA4_COMM_ALLOW_SHARED_GPU=1 RDNA4_COMM_TEST_JOBS=12 RDNA4_COMM_TEST_EXAMPLES=0.15 RDNA4_COMM_SKIP_BUILD=1 timeout -s INT $(( ${DEADLINE:-585} - $(el) )) \
  bash scripts/gpu_check.sh --timeout 200 -rfE --ignore=tests/test_vllm.py --ignore=tests/test_vllm_plugin.py \
  --ignore=tests/test_hip_compile.py --ignore=tests/test_cuda_compile.py > /tmp/o/suite.txt 2>&1
echo "suite rc=$? at $(el) s"; grep -v "Warning\|warner" /tmp/o/suite.txt | tail -8 | cut -c1-200
grep "^===" $OUT/failures.txt 2>/dev/null | cut -c1-200
