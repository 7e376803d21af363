# Adds %globaltimer phase stamps to a copy of csrc holding the v13 sources (main at the commit that added
# this directory): the v12 stamp patch beside ../small_batch_probes_h200_2026-12-03/, with combine's anchors
# as v13 has them (its short sum loop, its first reads before the generation).
#   python3 stamp_patch.py COPY_OF_CSRC
from pathlib import Path

V12 = Path(__file__).resolve().parent.parent / "small_batch_probes_h200_2026-12-03" / "stamp_patch.py"
SUM_V12 = "sum_row<D, typename decltype(tag)::type>(row_of"
SUM_V13 = "sum_row<D, typename decltype(tag)::type, 1, kSumUnroll>(row_of"
START_V12 = """  __shared__ CombineShared sh;
  const uint64_t gen = op_generation(env, kOpCombine);"""
START_V13 = """  __shared__ CombineShared sh;
  const bool receiver = int(blockIdx.x) >= lp.send_blocks;
  const OwnRange range = own_range(a.ntok, lp, int(blockIdx.x) - lp.send_blocks);
  const FirstReads first = first_reads(env, a, range, receiver);
  const uint64_t gen = op_generation(env, kOpCombine);"""
STAMPED_START_V12 = """  if (threadIdx.x == 0) for (int i = 0; i < 15; ++i) sh.st[i] = 0;
  ST(0);
  const uint64_t gen = op_generation(env, kOpCombine);"""
STAMPED_START_V13 = """  if (threadIdx.x == 0) for (int i = 0; i < 15; ++i) sh.st[i] = 0;
  ST(0);
  const bool receiver = int(blockIdx.x) >= lp.send_blocks;
  const OwnRange range = own_range(a.ntok, lp, int(blockIdx.x) - lp.send_blocks);
  const FirstReads first = first_reads(env, a, range, receiver);
  const uint64_t gen = op_generation(env, kOpCombine);"""
RECEIVER_V12 = "combine_receiver<D>(env, a, sh, gen, range, start, lp.vec);"
RECEIVER_V13 = "combine_receiver<D, kSumUnroll>(env, a, sh, gen, range, first, lp.vec);"



def v13_script() -> str:
    """The v12 stamp patch's source with the v13 anchors."""
    script = V12.read_text()
    for old, new in ((SUM_V12, SUM_V13), (STAMPED_START_V12, STAMPED_START_V13), (START_V12, START_V13),
                     (RECEIVER_V12, RECEIVER_V13)):
        assert old in script, old[:60]
        script = script.replace(old, new)
    return script


if __name__ == "__main__":
    exec(compile(v13_script(), str(V12), "exec"))
