#!/usr/bin/env bash
# The FP8 quantising loop with its next blocks' loads in flight (working
# tree) against main (.before/bmain): build both, the FP8 GPU tests of the
# tree, bench_kernels of both, then ncu warp stalls of the tree's dispatch
# and placement kernels (bench_kernels' ncu child).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD
RES=$OUT; export OUT=/tmp/o; mkdir -p $OUT
trap 'tar czf $RES/run.tgz -C /tmp o' EXIT
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
dir_of() { if [ $1 = head ]; then echo $ROOT; else echo $ROOT/.before/$1; fi; }
for t in head bmain; do
  (cd $(dir_of $t) && MAX_JOBS=8 python3 setup.py build_ext --inplace > $OUT/build_$t.log 2>&1; echo "build $t rc=$? at $(el) s") &
done
wait
(PYTHONPATH=$ROOT RDNA4_COMM_ALLOW_SHARED_GPU=1 timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_fp8_dispatch.py tests/test_fp8.py \
  > $OUT/tests_fp8.txt 2>&1; echo "fp8 tests rc=$? at $(el) s"; tail -3 $OUT/tests_fp8.txt | cut -c1-200)
for t in head bmain; do
  (cd $(dir_of $t) && PYTHONPATH=$(dir_of $t) timeout 150 python3 benchmarks/bench_kernels.py --rounds 3 --calls 30 \
     --out $OUT/bk_$t.jsonl > $OUT/bk_$t.txt 2>&1; echo "bench $t rc=$? at $(el) s")
  grep -E "^ *[0-9]+  " $OUT/bk_$t.txt | cut -c1-118
done
cd /tmp/o && PYTHONPATH=$ROOT timeout $(( ${DEADLINE:-570} - $(el) )) ncu --profile-from-start off --cache-control none --import-source no \
  --section WarpStateStats --section SourceCounters --section SpeedOfLight --warp-sampling-interval 0 \
  -k regex:"expert_place_kernel|dispatch_kernel" -o stalls python3 $ROOT/benchmarks/bench_kernels.py --ncu-child > ncu.txt 2>&1
echo "ncu rc=$? at $(el) s"
ncu -i stalls.ncu-rep --page source --csv --print-source sass | gzip > stalls.csv.gz && python3 $ROOT/benchmarks/ncu_stalls.py stalls.csv.gz > stalls.txt 2>&1
ncu -i stalls.ncu-rep --page details --csv > details.csv 2>&1
grep -c . stalls.txt
