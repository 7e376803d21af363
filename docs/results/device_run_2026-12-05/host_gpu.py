# Host time per eager call on the GPU transport (a world of one rank), the
# GPU kept busy by a sleep kernel ahead of each block: comm.dispatch, the raw
# op, combine, torch.empty on the device, torch.add.
import time, torch, torch.distributed as dist
import rdna4_comm as rc
from rdna4_comm._launch import free_port
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
torch.cuda.set_device(0)
comm = rc.Communicator(max_tokens_per_rank=8, hidden=7168, topk=8, num_experts=256, dtype=torch.bfloat16, transport="gpu")
dev = torch.device("cuda", 0)
x = torch.randn(8, 7168, device=dev).bfloat16(); idx = torch.rand(8, 256).topk(8, dim=1).indices.to(dev); w = torch.rand(8, 8, device=dev).bfloat16()
def t(f, n=50, blocks=30):
    for _ in range(3): f()
    torch.cuda.synchronize()
    best = []
    for _ in range(blocks):
        torch.cuda._sleep(20_000_000)
        s = time.perf_counter()
        for _ in range(n): f()
        best.append((time.perf_counter() - s) / n * 1e6)
        torch.cuda.synchronize()
    best.sort()
    return round(best[len(best) // 2], 2)
res = {"comm.dispatch": t(lambda: comm.dispatch(x, idx, w))}
try:
    from rdna4_comm.ops import op_callable
    f = op_callable("dispatch", False)
except Exception:
    f = torch.ops.rdna4_comm.dispatch
res["raw dispatch op"] = t(lambda: f(x, idx, w, comm._order, comm.id))
d = comm.dispatch(x, idx, w)
res["comm.combine"] = t(lambda: comm.combine(d.x, d.handle))
res["torch.empty([1] int64)"] = t(lambda: torch.empty(1, dtype=torch.int64, device=dev))
a = torch.zeros(8, device=dev)
res["torch.add"] = t(lambda: torch.add(a, a))
print(res)
comm.close(); dist.destroy_process_group()
