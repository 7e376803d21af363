#!/usr/bin/env bash
# One tree (the working tree): build, bench ROWS, the sanitizer tools TOOLS
# on scripts/sanitize_ops.py, GPU tests SUITE_TESTS with ranks sharing the
# GPU, within DEADLINE seconds.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT; S=$OUT/summary.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $S
MAX_JOBS=16 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1; echo "build rc=$? at $(el) s" >> $S
PYTHONPATH=$PWD timeout 100 python3 benchmarks/bench_kernels.py --rounds 3 --calls 30 --rows $ROWS --out $OUT/bk.jsonl > $OUT/bk.txt 2>&1
echo "bench rc=$? at $(el) s" >> $S; grep -E "^ *[0-9]+  " $OUT/bk.txt | cut -c1-120 >> $S
for tool in ${TOOLS:-racecheck memcheck synccheck}; do
  RDNA4_COMM_ALLOW_SHARED_GPU=1 PYTHONPATH=$PWD timeout 90 compute-sanitizer --tool $tool --target-processes all --error-exitcode 3 \
    python3 scripts/sanitize_ops.py > $OUT/san_$tool.log 2>&1
  echo "$tool rc=$? at $(el) s" >> $S; grep -E "(ERROR|RACECHECK) SUMMARY|^sanitize_ops" $OUT/san_$tool.log | cut -c1-160 >> $S
done
RDNA4_COMM_SKIP_BUILD=1 RDNA4_COMM_ALLOW_SHARED_GPU=1 RDNA4_COMM_TEST_JOBS=12 RDNA4_COMM_TEST_EXAMPLES=0.15 OUT=/tmp/suite \
  timeout -s INT $(( ${DEADLINE:-400} - $(el) - 10 )) bash scripts/gpu_check.sh $SUITE_TESTS --timeout 200 -rfE > $OUT/suite.txt 2>&1
echo "suite rc=$? at $(el) s" >> $S; grep -v "Warning\|warner" $OUT/suite.txt | tail -6 | cut -c1-200 >> $S
cp /tmp/suite/failures.txt $OUT/failures.txt 2>/dev/null
cat $S
