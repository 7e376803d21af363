#!/usr/bin/env bash
# Device run: build, in parallel, the working tree (head: the call word's
# loads before its store, the expert placement's one-chunk path), b41 (HEAD
# 1a5b00a with the pybind11 2.x fix: the kernels before both), b43
# (0d67339, before issue 43's op table) and b40 (434c6f0, before issue 40's
# call checks); bench_kernels of each; ep_kernel_times of head and b41; the
# GPU suite with ranks sharing the GPU; compute-sanitizer in the time left.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD
RES=$OUT; export OUT=/tmp/o; mkdir -p $OUT
trap 'tar czf $RES/run.tgz -C /tmp o' EXIT
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
dir_of() { if [ $1 = head ]; then echo $ROOT; else echo $ROOT/.before/$1; fi; }
for t in head b41 b43 b40; do
  (cd $(dir_of $t) && MAX_JOBS=5 python3 setup.py build_ext --inplace > $OUT/build_$t.log 2>&1; echo "build $t rc=$? at $(el) s") &
done
wait
grep -h -m3 "error" $OUT/build_*.log
for t in head b41 b43 b40; do
  dir=$(dir_of $t)
  (cd $dir && PYTHONPATH=$dir timeout 120 python3 benchmarks/bench_kernels.py --rounds 3 --calls 30 \
     --out $OUT/bk_$t.jsonl > $OUT/bk_$t.txt 2>&1; echo "bench $t rc=$? at $(el) s")
  grep -E "^ *[0-9]+  " $OUT/bk_$t.txt | cut -c1-118
done
for t in head b41; do
  (cd $(dir_of $t) && PYTHONPATH=$(dir_of $t) timeout 40 python3 benchmarks/ep_kernel_times.py --alignment 1 > $OUT/ekt_$t.txt 2>&1; echo "ekt $t rc=$? at $(el) s")
done
for t in head b43 b40; do
  (cd $(dir_of $t) && PYTHONPATH=$(dir_of $t) timeout 30 python3 $ROOT/.devrun/host_gpu.py 2>&1 | tail -1; echo "host $t at $(el) s")
done
left=$(( ${DEADLINE:-510} - 80 - $(el) ))
echo "tests get $left s"
RDNA4_COMM_ALLOW_SHARED_GPU=1 RDNA4_COMM_TEST_JOBS=8 timeout $left bash scripts/gpu_check.sh \
  --timeout 150 -rfE --ignore=tests/test_vllm.py --ignore=tests/test_vllm_plugin.py --ignore=tests/test_hip_compile.py \
  --ignore=tests/test_cuda_compile.py --ignore=tests/test_readme.py --ignore=tests/test_benchmarks.py \
  > $OUT/tests.txt 2>&1
echo "tests rc=$? at $(el) s"; grep -E "passed|failed|FAILED|ERROR" $OUT/tests.txt | tail -15 | cut -c1-240
left=$(( ${DEADLINE:-510} - $(el) ))
if [ $left -gt 40 ]; then
  RDNA4_COMM_SKIP_BUILD=1 timeout $left bash scripts/gpu_sanitize.sh > $OUT/sanitize.txt 2>&1; echo "sanitize rc=$? at $(el) s"; cut -c1-160 $OUT/sanitize.txt
fi
