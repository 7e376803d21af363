# Adds %globaltimer phase stamps to a copy of csrc of commit bcf7358 (v14) with param_warmup.patch and
# no_trailing_barrier.patch (beside this file) applied, the tree stamped in device run 21: the v13 stamp patch
# (../small_batch_probes_h200_2026-12-03_b/) with the anchors that v14 and the two patches changed.
#   python3 stamp_patch.py COPY_OF_CSRC
import importlib.util
from pathlib import Path

V13 = Path(__file__).resolve().parent.parent / "small_batch_probes_h200_2026-12-03_b" / "stamp_patch.py"
spec = importlib.util.spec_from_file_location("stamp_patch_v13", V13)
v13 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(v13)

PAIRS = [
    # dispatch: the stamps around the parameter warm-up and the generation
    ('''    ("""  __shared__ DispatchShared sh;
  prefetch_sender_inputs<IdxT, kMode>(a, env.layout, lp, blockIdx.x);
  const uint64_t gen = op_generation(env, kOpDispatch);
  bool have_headers;""", """  __shared__ DispatchShared sh;
  if (threadIdx.x == 0) for (int i = 0; i < 15; ++i) sh.st[i] = 0;
  ST(0);
  prefetch_sender_inputs<IdxT, kMode>(a, env.layout, lp, blockIdx.x);
  const uint64_t gen = op_generation(env, kOpDispatch);
  if (gen == 0x123456789ull) sh.st[15] = 1;
  ST(14);
  bool have_headers;"""),''', '''    ("""  __shared__ DispatchShared sh;
  warm_param_lines(env);""", """  __shared__ DispatchShared sh;
  if (threadIdx.x == 0) for (int i = 0; i < 15; ++i) sh.st[i] = 0;
  ST(0);
  warm_param_lines(env);"""),
    ("""  const uint64_t gen = op_generation(env, kOpDispatch);""", """  const uint64_t gen = op_generation(env, kOpDispatch);
  if (gen == 0x123456789ull) sh.st[15] = 1;
  ST(14);"""),'''),
    # dispatch: a sender's padding start per warp (received_rows) instead of the headers
    ('''    ("""    have_headers =
        dispatch_sender<IdxT, KF, V, kMode>(env, a, lp, sh, gen, blockIdx.x) && load_headers(env, sh, gen, own);
  } else {""", """    have_headers = dispatch_sender<IdxT, KF, V, kMode>(env, a, lp, sh, gen, blockIdx.x);
    ST(9);
    have_headers = have_headers && load_headers(env, sh, gen, own);
    ST(10);
  } else {"""),''', '''    ("""    have_headers = dispatch_sender<IdxT, KF, V, kMode>(env, a, lp, sh, gen, blockIdx.x) &&
                   received_rows(env, sh, gen, dispatch_routes_all_tokens(a.ntok), &pad0);""", """    have_headers = dispatch_sender<IdxT, KF, V, kMode>(env, a, lp, sh, gen, blockIdx.x);
    ST(9);
    have_headers = have_headers && received_rows(env, sh, gen, dispatch_routes_all_tokens(a.ntok), &pad0);
    ST(10);"""),'''),
    ('''("""  if (have_headers) dispatch_padding<IdxT>(env, a, sh.src);
  finish_op(env, kOpDispatch, gen);
}""", f"""  ST(11);
  if (have_headers) dispatch_padding<IdxT>(env, a, sh.src);''', '''("""  if (have_headers) dispatch_padding<IdxT>(env, a, pad0);
  finish_op(env, kOpDispatch, gen);
}""", f"""  ST(11);
  if (have_headers) dispatch_padding<IdxT>(env, a, pad0);'''),
    ('''    ("""  if (!load_headers(env, sh, gen, OwnHeader{false, 0, 0})) return false;
  if (j == 0 && tid < W) {""", """  if (!load_headers(env, sh, gen, OwnHeader{false, 0, 0})) return false;
  ST(1);''', '''    ("""  if (!load_headers(env, sh, gen)) return false;
  if (j == 0 && tid < W) {""", """  if (!load_headers(env, sh, gen)) return false;
  ST(1);'''),
    # combine: no barrier after a batch's sums (no_trailing_barrier.patch)
    ('''    ("""          sum_row<D, typename decltype(tag)::type, 1, kSumUnroll>(row_of, sh.batch_mask[i], out + tok * payload, s);
        });
      });
      block_sync();""", """          sum_row<D, typename decltype(tag)::type, 1, kSumUnroll>(row_of, sh.batch_mask[i], out + tok * payload, s);
        });
      });
      ST(6);
      block_sync();
      ST(7);"""),''', '''    ("""          sum_row<D, typename decltype(tag)::type, 1, kSumUnroll>(row_of, sh.batch_mask[i], out + tok * payload, s);
        });
      });""", """          sum_row<D, typename decltype(tag)::type, 1, kSumUnroll>(row_of, sh.batch_mask[i], out + tok * payload, s);
        });
      });
      ST(6);"""),'''),
    # combine: the start (parameter warm-up, own_range before the generation) and the receiver's call
    ('''    ("""  __shared__ CombineShared sh;
  const bool receiver = int(blockIdx.x) >= lp.send_blocks;
  const OwnRange range = own_range(a.ntok, lp, int(blockIdx.x) - lp.send_blocks);
  const FirstReads first = first_reads(env, a, range, receiver);
  const uint64_t gen = op_generation(env, kOpCombine);""", """  __shared__ CombineShared sh;
  if (threadIdx.x == 0) for (int i = 0; i < 15; ++i) sh.st[i] = 0;
  ST(0);
  const bool receiver = int(blockIdx.x) >= lp.send_blocks;
  const OwnRange range = own_range(a.ntok, lp, int(blockIdx.x) - lp.send_blocks);
  const FirstReads first = first_reads(env, a, range, receiver);
  const uint64_t gen = op_generation(env, kOpCombine);''', '''    ("""  __shared__ CombineShared sh;
  warm_param_lines(env);""", """  __shared__ CombineShared sh;
  if (threadIdx.x == 0) for (int i = 0; i < 15; ++i) sh.st[i] = 0;
  ST(0);
  warm_param_lines(env);"""),
    ("""  const uint64_t gen = op_generation(env, kOpCombine);""", """  const uint64_t gen = op_generation(env, kOpCombine);'''),
    ('''combine_receiver<D, kSumUnroll>(env, a, sh, gen, range, first, lp.vec);
  }
  finish_op(env, kOpCombine, gen);
}""", f"""    combine_receiver<D, kSumUnroll>(env, a, sh, gen, range, first, lp.vec);''', '''combine_receiver<D, kSumUnroll>(env, a, sh, gen, range, first, pieces, lp.vec);
  }
  finish_op(env, kOpCombine, gen);
}""", f"""    combine_receiver<D, kSumUnroll>(env, a, sh, gen, range, first, pieces, lp.vec);'''),
]

script = v13.v13_script()
for old, new in PAIRS:
    assert old in script, old[:60]
    script = script.replace(old, new, 1)
exec(compile(script, str(V13), "exec"))
