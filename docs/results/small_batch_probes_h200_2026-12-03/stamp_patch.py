# Adds %globaltimer phase stamps (thread 0 of each block, printed every 16th generation) to a copy of csrc:
#   python3 stamp_patch.py COPY_OF_CSRC   (the v12 sources; README.txt beside this file)
import sys
root = sys.argv[1]
def patch(p, pairs):
    s = open(p).read()
    for old, new in pairs:
        assert old in s, (p, old[:60])
        s = s.replace(old, new, 1)
    open(p, 'w').write(s)
STAMP = """__device__ __forceinline__ void stamp(uint64_t* st, int i) {
  if (threadIdx.x == 0) { uint64_t t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory"); st[i] = t; }
}
#define ST(i) stamp(sh.st, i)
"""
def pr(n):
    fmt = ' '.join(['%lld'] * n)
    args = ', '.join(f'sh.st[{i}] ? (long long)(sh.st[{i}]-sh.st[0]) : -1LL' for i in range(1, n + 1))
    return fmt, args
fmt, args = pr(14)
patch(f'{root}/gpu/dispatch.cu', [
    ('#include "device/fp8_rows.cuh"', '#include <cstdio>\n#include "device/fp8_rows.cuh"'),
    ("enum PayloadMode", STAMP + "enum PayloadMode"),
    ("""  uint32_t item_row_start[kMaxGroup], item_first[kMaxGroup + 1];
};""", """  uint32_t item_row_start[kMaxGroup], item_first[kMaxGroup + 1];
  uint64_t st[16];
};"""),
    ("""    const uint32_t m = tid < T ? route.mask(tid) : 0u;
    if (tid >= t0 && tid < t1) a.out_send_mask[tid] = int32_t(m);
    int32_t pos[kMaxGpuWorld];
    batch_positions(m, W, pos, sh.warp_tot, sh.run);""", """    const uint32_t m = tid < T ? route.mask(tid) : 0u;
    if (tid >= t0 && tid < t1) a.out_send_mask[tid] = int32_t(m);
    if (m == 0xdeadbeefu) sh.st[15] = 1;
    ST(1);
    int32_t pos[kMaxGpuWorld];
    batch_positions(m, W, pos, sh.warp_tot, sh.run);
    ST(2);"""),
    ("""  const bool have_base = lower_rows(false);
  send(have_base ? all_ranks(env) : peer_ranks(env));""", """  ST(3);
  const bool have_base = lower_rows(false);
  ST(4);
  send(have_base ? all_ranks(env) : peer_ranks(env));
  ST(8);"""),
    ("""        if (!s.lead) return;
#pragma unroll""", """        ST(5);
        if (!s.lead) return;
#pragma unroll"""),
    ("""        if (s.first == 0) {
          for (uint32_t m = tm; m != 0; m &= m - 1) {""", """        ST(6);
        if (s.first == 0) {
          for (uint32_t m = tm; m != 0; m &= m - 1) {"""),
    ("""  __shared__ DispatchShared sh;
  prefetch_sender_inputs<IdxT, kMode>(a, env.layout, lp, blockIdx.x);
  const uint64_t gen = op_generation(env, kOpDispatch);
  bool have_headers;""", """  __shared__ DispatchShared sh;
  if (threadIdx.x == 0) for (int i = 0; i < 15; ++i) sh.st[i] = 0;
  ST(0);
  prefetch_sender_inputs<IdxT, kMode>(a, env.layout, lp, blockIdx.x);
  const uint64_t gen = op_generation(env, kOpDispatch);
  if (gen == 0x123456789ull) sh.st[15] = 1;
  ST(14);
  bool have_headers;"""),
    ("""    have_headers =
        dispatch_sender<IdxT, KF, V, kMode>(env, a, lp, sh, gen, blockIdx.x) && load_headers(env, sh, gen, own);
  } else {""", """    have_headers = dispatch_sender<IdxT, KF, V, kMode>(env, a, lp, sh, gen, blockIdx.x);
    ST(9);
    have_headers = have_headers && load_headers(env, sh, gen, own);
    ST(10);
  } else {"""),
    ("""  if (have_headers) dispatch_padding<IdxT>(env, a, sh.src);
  finish_op(env, kOpDispatch, gen);
}""", f"""  ST(11);
  if (have_headers) dispatch_padding<IdxT>(env, a, sh.src);
  ST(12);
  finish_op(env, kOpDispatch, gen);
  ST(13);
  if (threadIdx.x == 0 && (gen & 15) == 0 && a.ntok <= 128) {{
    uint32_t smid; asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    printf("STAMP D T=%d b=%d sm=%u send=%d gen=%llu t0=%llu d={fmt}\\n", int(a.ntok), int(blockIdx.x), smid,
           int(blockIdx.x) < lp.send_blocks, (unsigned long long)gen, (unsigned long long)sh.st[0], {args});
  }}
}}"""),
    ("""  if (!load_headers(env, sh, gen, OwnHeader{false, 0, 0})) return false;
  if (j == 0 && tid < W) {""", """  if (!load_headers(env, sh, gen, OwnHeader{false, 0, 0})) return false;
  ST(1);
  if (j == 0 && tid < W) {"""),
])
fmt, args = pr(9)
patch(f'{root}/gpu/combine.cu', [
    ('#include "device/rows.cuh"', '#include <cstdio>\n#include "device/rows.cuh"'),
    ("""  int32_t own_row[kThreads];
};""", """  int32_t own_row[kThreads];
  uint64_t st[16];
};
""" + STAMP),
    ("""    if (!block_all(ok)) return;
    const int32_t b_begin""", """    if (!block_all(ok)) return;
    ST(3);
    const int32_t b_begin"""),
    ("""      sh.own_row[tid] = own_base + pos[0] < rows ? own_base + pos[0] : rows - 1;
      block_sync();""", """      sh.own_row[tid] = own_base + pos[0] < rows ? own_base + pos[0] : rows - 1;
      ST(4);
      block_sync();
      ST(5);"""),
    ("""          sum_row<D, typename decltype(tag)::type>(row_of, sh.batch_mask[i], out + tok * payload, s);
        });
      });
      block_sync();""", """          sum_row<D, typename decltype(tag)::type>(row_of, sh.batch_mask[i], out + tok * payload, s);
        });
      });
      ST(6);
      block_sync();
      ST(7);"""),
    ("""  check_recv_src(env, a, sh.src, b, nblocks);
  peer_chunk_starts(env, a, sh);""", """  check_recv_src(env, a, sh.src, b, nblocks);
  peer_chunk_starts(env, a, sh);
  ST(3);"""),
    ("""  __shared__ CombineShared sh;
  const uint64_t gen = op_generation(env, kOpCombine);""", """  __shared__ CombineShared sh;
  if (threadIdx.x == 0) for (int i = 0; i < 15; ++i) sh.st[i] = 0;
  ST(0);
  const uint64_t gen = op_generation(env, kOpCombine);
  if (gen == 0x123456789ull) sh.st[15] = 1;
  ST(1);"""),
    ("""    return handle_counts_ok(env, a, s, *nrows, *ntok);
  });
  if (!counts_ok) {""", """    return handle_counts_ok(env, a, s, *nrows, *ntok);
  });
  ST(2);
  if (!counts_ok) {"""),
    ("""    combine_receiver<D>(env, a, sh, gen, range, start, lp.vec);
  }
  finish_op(env, kOpCombine, gen);
}""", f"""    combine_receiver<D>(env, a, sh, gen, range, start, lp.vec);
  }}
  ST(8);
  finish_op(env, kOpCombine, gen);
  ST(9);
  if (threadIdx.x == 0 && (gen & 15) == 0 && a.ntok <= 128) {{
    uint32_t smid; asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    printf("STAMP C T=%d b=%d sm=%u send=%d gen=%llu t0=%llu d={fmt}\\n", int(a.ntok), int(blockIdx.x), smid,
           int(blockIdx.x) < lp.send_blocks, (unsigned long long)gen, (unsigned long long)sh.st[0], {args});
  }}
}}"""),
])
