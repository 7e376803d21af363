#!/usr/bin/env bash
# Device run for branch wip/gpu-latency (run from a checkout of the branch):
# build head (the branch), bmain (main c8b8a16) and b40 (434c6f0, before
# issue 40's call checks) in parallel; the expert-layout and EP GPU tests of
# head first (the changed kernels: expert placement, the fused expert
# combine, begin_round, the pinned check word), with ranks sharing the GPU;
# bench_kernels of the three trees; ep_kernel_times of head and bmain;
# compute-sanitizer of head in the time left. The rest of the GPU suite:
# run5.sh.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD
RES=$OUT; export OUT=/tmp/o; mkdir -p $OUT
trap 'tar czf $RES/run.tgz -C /tmp o' EXIT
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
dir_of() { if [ $1 = head ]; then echo $ROOT; else echo $ROOT/.before/$1; fi; }
for t in head bmain b40; do
  (cd $(dir_of $t) && MAX_JOBS=5 python3 setup.py build_ext --inplace > $OUT/build_$t.log 2>&1; echo "build $t rc=$? at $(el) s") &
done
wait
grep -h -m3 "error" $OUT/build_*.log
RDNA4_COMM_ALLOW_SHARED_GPU=1 RDNA4_COMM_TEST_JOBS=8 timeout 200 bash scripts/gpu_check.sh \
  --timeout 150 -rfE tests/test_expert_layout.py tests/test_gpu.py tests/test_ep.py tests/test_fp8_dispatch.py \
  tests/test_moe.py tests/test_calls_agree.py > $OUT/tests_ep.txt 2>&1
echo "tests_ep rc=$? at $(el) s"; grep -E "passed|failed|FAILED|ERROR" $OUT/tests_ep.txt | tail -15 | cut -c1-240
for t in head bmain b40; do
  dir=$(dir_of $t)
  (cd $dir && PYTHONPATH=$dir timeout 120 python3 benchmarks/bench_kernels.py --rounds 3 --calls 30 \
     --out $OUT/bk_$t.jsonl > $OUT/bk_$t.txt 2>&1; echo "bench $t rc=$? at $(el) s")
  grep -E "^ *[0-9]+  " $OUT/bk_$t.txt | cut -c1-118
done
for t in head bmain; do
  (cd $(dir_of $t) && PYTHONPATH=$(dir_of $t) timeout 40 python3 benchmarks/ep_kernel_times.py --alignment 1 > $OUT/ekt_$t.txt 2>&1; echo "ekt $t rc=$? at $(el) s")
done
left=$(( ${DEADLINE:-540} - $(el) ))
if [ $left -gt 40 ]; then
  RDNA4_COMM_SKIP_BUILD=1 timeout $left bash scripts/gpu_sanitize.sh > $OUT/sanitize.txt 2>&1; echo "sanitize rc=$? at $(el) s"; cut -c1-160 $OUT/sanitize.txt
fi
