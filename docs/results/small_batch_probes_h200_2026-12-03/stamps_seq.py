# Stamps of dispatch and combine (T = 8, H = 4096) in three sequences, one call at a time with a sync
# between: alternating, dispatch only, combine only. The lab build prints every 16th generation.
import sys, torch, torch.distributed as dist
from rdna4_comm._ranks import one_rank
from rdna4_comm._bench.kernel_cases import ep_inputs, EP_TOPK, DTYPE
from rdna4_comm._bench.cases import EP_EXPERTS
from rdna4_comm.communicator import Communicator
rank = one_rank("cuda")
comm = Communicator(dist.group.WORLD, max_tokens_per_rank=8, hidden=4096, topk=EP_TOPK, num_experts=EP_EXPERTS,
                    dtype=DTYPE, transport="gpu")
x, idx, w = ep_inputs(8, 4096, rank.device)
d0 = comm.dispatch(x, idx, w)
def alt():
    d = comm.dispatch(x, idx, w); comm.combine(d.x, d.handle)
seqs = {"alternating": alt, "dispatch only": lambda: comm.dispatch(x, idx, w),
        "combine only": lambda: comm.combine(d0.x, d0.handle)}
for name, f in seqs.items():
    for _ in range(32):
        f(); torch.cuda.synchronize()
    print(f"=== {name}", flush=True)
    for _ in range(96):
        f(); torch.cuda.synchronize()
    print("", flush=True)
