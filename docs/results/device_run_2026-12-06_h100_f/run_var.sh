#!/usr/bin/env bash
# Build .before/{base,br,br2} side by side, then bench_kernels rows BK_ROWS of
# each (br, br2, base, br2, br while the deadline allows). Summaries on stdout.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD; O=$OUT; mkdir -p $O/v
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name --format=csv,noheader
for t in base br br2; do
  (cd $ROOT/.before/$t && MAX_JOBS=5 python3 setup.py build_ext --inplace > $O/v/build_$t.log 2>&1; echo "build $t rc=$? at $(el) s") &
done
wait
bench() {
  d=$ROOT/.before/$1
  (cd $d && PYTHONPATH=$d timeout 60 python3 benchmarks/bench_kernels.py --rounds 3 --calls 30 --rows $BK_ROWS \
     --out $O/v/bk_$1_$2.jsonl > $O/v/bk_$1_$2.txt 2>&1; echo "bench $1 $2 rc=$? at $(el) s")
  grep -E "^ *[0-9]+  " $O/v/bk_$1_$2.txt | cut -c1-150
  grep -E "^  dc_expert_decode: " $O/v/bk_$1_$2.txt
}
bench br 1; bench br2 1; bench base 1
[ $(el) -lt $(( ${DEADLINE:-250} - 30 )) ] && bench br2 2
[ $(el) -lt $(( ${DEADLINE:-250} - 30 )) ] && bench br 2
(cd $O && tar -czf logs.tar.gz v && rm -rf v)
echo "done at $(el) s"
