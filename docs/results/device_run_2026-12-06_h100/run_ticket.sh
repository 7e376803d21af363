#!/usr/bin/env bash
# Two trees on one GPU: the working tree (head: the expert tally's last
# block computes the offsets) and main with the call checks compiled out
# (.before/nocheck: begin_round always takes its no-call path, so no call
# word is stored or compared, and combine does not load its handle's
# round). Build both, the expert-layout GPU tests of head (dist alone too),
# bench_kernels of each, bench_call_mismatch on 2 ranks sharing the GPU,
# then bench_kernels of nocheck and head again until the deadline.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD
# Everything goes straight under $OUT, so a run cut off by its limit still returns what it finished.
mkdir -p $OUT
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
dir_of() { if [ $1 = head ]; then echo $ROOT; else echo $ROOT/.before/$1; fi; }
nvidia-smi --query-gpu=name --format=csv,noheader
for t in head nocheck; do
  (cd $(dir_of $t) && MAX_JOBS=8 python3 setup.py build_ext --inplace > $OUT/build_$t.log 2>&1; echo "build $t rc=$? at $(el) s") &
done
wait
bench() {
  (cd $(dir_of $1) && PYTHONPATH=$(dir_of $1) timeout 150 python3 benchmarks/bench_kernels.py --rounds 3 --calls 30 \
     --out $OUT/bk_$1_$2.jsonl > $OUT/bk_$1_$2.txt 2>&1; echo "bench $1 $2 rc=$? at $(el) s")
  grep -E "^ *[0-9]+  " $OUT/bk_$1_$2.txt | cut -c1-118
}
RDNA4_COMM_ALLOW_SHARED_GPU=1 OUT=$OUT/tests timeout 110 bash scripts/gpu_check.sh \
  tests/test_expert_layout.py -k "several_chunks or every_routing or back_to_back" \
  -rfE > $OUT/tests_expert.txt 2>&1
echo "expert tests rc=$? at $(el) s"; grep -E "passed|failed|FAILED|ERROR" $OUT/tests_expert.txt | tail -6 | cut -c1-220
RDNA4_COMM_ALLOW_SHARED_GPU=1 RDNA4_COMM_TEST_TRANSPORTS=dist OUT=$OUT/tests_dist timeout 40 bash scripts/gpu_check.sh \
  tests/test_expert_layout.py -k dist_alone -rfE > $OUT/tests_dist_alone.txt 2>&1
echo "dist alone rc=$? at $(el) s"; grep -E "passed|failed|FAILED|ERROR|skipped" $OUT/tests_dist_alone.txt | tail -4 | cut -c1-220
RDNA4_COMM_ALLOW_SHARED_GPU=1 PYTHONPATH=$ROOT timeout 60 python3 benchmarks/bench_call_mismatch.py --transport gpu --world 2 \
  --out $OUT/call_mismatch_gpu_w2.jsonl > $OUT/call_mismatch_gpu_w2.txt 2>&1
echo "mismatch rc=$? at $(el) s"; cut -c1-150 $OUT/call_mismatch_gpu_w2.txt | tail -22
bench head 1; bench nocheck 1
[ $(el) -lt $(( ${DEADLINE:-560} - 120 )) ] && bench nocheck 2
[ $(el) -lt $(( ${DEADLINE:-560} - 60 )) ] && bench head 2
echo "done at $(el) s"
