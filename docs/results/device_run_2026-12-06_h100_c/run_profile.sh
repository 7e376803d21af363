#!/usr/bin/env bash
# The working tree: build, bench_kernels with ncu columns (DRAM throughput,
# instructions per DRAM byte), then ncu warp stalls of every dispatch and
# combine kernel bench_kernels' ncu child runs. Summaries on stdout.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD
mkdir -p $OUT
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name --format=csv,noheader
MAX_JOBS=16 python3 setup.py build_ext --inplace > /tmp/build.log 2>&1; echo "build rc=$? at $(el) s"
PYTHONPATH=$ROOT timeout 260 python3 benchmarks/bench_kernels.py --rounds 3 --calls 30 --ncu --out $OUT/bk_ncu.jsonl > $OUT/bk_ncu.txt 2>&1
echo "bench_kernels --ncu rc=$? at $(el) s"
grep -E "^ *[0-9]+  |^  [a-z_0-9]+ +\|" $OUT/bk_ncu.txt | cut -c1-200 | head -60
mkdir -p /tmp/ncu && cd /tmp/ncu && PYTHONPATH=$ROOT timeout 200 ncu --profile-from-start off --cache-control none --import-source no \
  --section WarpStateStats --section SourceCounters --section SpeedOfLight --warp-sampling-interval 0 \
  -k regex:"dispatch_kernel|combine_kernel" -o stalls python3 $ROOT/benchmarks/bench_kernels.py --ncu-child > ncu.txt 2>&1
echo "ncu rc=$? at $(el) s"; tail -2 ncu.txt | cut -c1-200
ncu -i stalls.ncu-rep --page source --csv --print-source sass | gzip > stalls.csv.gz && python3 $ROOT/benchmarks/ncu_stalls.py stalls.csv.gz > $OUT/ncu_stalls.txt 2>&1
echo "stalls at $(el) s"; cd $ROOT
grep -n "^void\|samples" $OUT/ncu_stalls.txt | cut -c1-170
