"""Greedy generation with vLLM, with or without the rdna4_comm plugin, for
tests/test_vllm.py and benchmarks/bench_vllm.py. Run as a script (vLLM
starts its own processes; its ``LLM(...)`` must be under ``__main__``)::

    python tests/with_vllm/generate.py '{"model": DIR, "tp": 2, "ep": true, "plugin": {"strict": true}}'

prints one line ``RESULT <json>``: the generated token ids per prompt (in
prompt order, whichever data-parallel rank ran them), the engine start and
generation times (with ``"rounds": n``, n timed rounds of the whole batch and
of one prompt alone), per worker the plugin's communicators (name, transport,
world size), the workers' process ids, and the library's ops found in the
code vLLM compiled.

Data parallelism runs one process per DP rank, each with its own ``LLM``
and its share of the prompts (vLLM's offline data-parallel form).
"""
from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import re
import sys
import tempfile
import time

PROMPTS = ([1, 5, 9, 33, 70], [100, 200, 300], [7, 7, 7, 7, 7, 7, 7], [311, 2, 45, 260])


def _worker_state(worker) -> tuple:
    """In a vLLM worker: its process id (which starts the names of the
    shared-memory segments its communicators create) and the plugin's
    communicators over its groups."""
    from vllm.distributed import parallel_state as ps

    found = {}
    for group in (ps._TP, ps._EP, ps._DP, ps._WORLD):
        for name, comm in (group.__dict__.get("_rdna4_comm_communicators", {}) if group else {}).items():
            found[name] = dict(transport=comm.transport, world=comm.world_size, rank=comm.rank)
    return os.getpid(), found


def compiled_ops(cache_root: str, since: float) -> dict:
    """How often each torch.ops.rdna4_comm op appears in the Python code that
    Inductor wrote into vLLM's compile cache under ``cache_root`` from
    ``since`` (a time.time()) on: the code this run compiled."""
    counts: dict = {}
    for path in glob.glob(os.path.join(cache_root, "torch_compile_cache", "**", "*.py"), recursive=True):
        if os.path.getmtime(path) < since:
            continue
        with open(path, errors="replace") as f:
            for op in re.findall(r"torch\.ops\.rdna4_comm\.(\w+)\.default", f.read()):
                counts[op] = counts.get(op, 0) + 1
    return counts


def run_engine(spec: dict, prompts: list, out, dp_rank: int = 0) -> None:
    """One LLM (one DP rank, or the whole engine), its generation, its report."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=spec["model"], skip_tokenizer_init=True, tensor_parallel_size=spec.get("tp", 1),
                  enable_expert_parallel=spec.get("ep", False), enforce_eager=not spec.get("compile", False),
                  gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.05), max_model_len=256,
                  max_num_batched_tokens=spec.get("max_num_batched_tokens", 128), max_num_seqs=8,
                  dtype=spec.get("dtype", "float32"), seed=0)
    kwargs.update(spec.get("llm_kwargs", {}))
    if spec.get("plugin") is not None:
        kwargs["additional_config"] = {"rdna4_comm": spec["plugin"]}
    start = time.perf_counter()
    llm = LLM(**kwargs)
    started = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True, detokenize=False)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    outputs = llm.generate(requests, params, use_tqdm=False)
    done = time.perf_counter()
    # Timed rounds (the benchmark): the whole batch, then one prompt alone,
    # whose time per generated token is a decode step's latency.
    batch_s, step_s = [], []
    for _ in range(spec.get("rounds", 0)):
        t0 = time.perf_counter()
        llm.generate(requests, params, use_tqdm=False)
        t1 = time.perf_counter()
        llm.generate(requests[:1], params, use_tqdm=False)
        batch_s.append(t1 - t0)
        step_s.append((time.perf_counter() - t1) / params.max_tokens)
    pids, state = zip(*llm.collective_rpc(_worker_state))
    out.put(dict(dp_rank=dp_rank, tokens=[list(o.outputs[0].token_ids) for o in outputs], start_s=started - start,
                 generate_s=done - started, batch_s=batch_s, step_s=step_s, workers=list(state), worker_pids=list(pids)))
    llm.llm_engine.engine_core.shutdown()


def _dp_rank(spec: dict, rank: int, port: int, out) -> None:
    os.environ.update(VLLM_DP_RANK=str(rank), VLLM_DP_RANK_LOCAL=str(rank), VLLM_DP_SIZE=str(spec["dp"]),
                      VLLM_DP_MASTER_IP="127.0.0.1", VLLM_DP_MASTER_PORT=str(port))
    try:
        run_engine(spec, spec["prompts"][rank::spec["dp"]], out, rank)
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which raises)
        out.put(dict(error=f"DP rank {rank}: {type(e).__name__}: {e}"))
        raise


def generate(spec: dict) -> dict:
    spec = dict(spec, prompts=[list(p) for p in spec.get("prompts", PROMPTS)])
    # A cache shared by the runs of a session (VLLM_CACHE_ROOT) spares each
    # engine vLLM's inspection of the model class; the code this run
    # compiled is in the cache entries it added.
    cache_root = os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm_cache_"))
    since = time.time()
    # The engine core in the LLM's own process: one process start (about 8 s
    # on two cores) fewer per engine; the workers are processes either way.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of _worker_state
    dp = spec.get("dp", 1)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    if dp == 1:
        run_engine(spec, spec["prompts"], out)
        reports = [out.get()]
    else:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [ctx.Process(target=_dp_rank, args=(spec, r, port, out)) for r in range(dp)]
        for p in procs:
            p.start()
        reports = [out.get(timeout=spec.get("timeout_s", 600)) for _ in range(dp)]
        for p in procs:
            p.join(60)
            if p.exitcode is None:
                p.kill()
        errors = [r["error"] for r in reports if "error" in r]
        if errors:
            raise RuntimeError("; ".join(errors))
    # DP rank r ran prompts r, r + dp, ...
    tokens = [None] * len(spec["prompts"])
    for report in reports:
        tokens[report["dp_rank"]::dp] = report["tokens"]
    # Data-parallel ranks run side by side: a round takes as long as the slowest.
    return dict(tokens=tokens, start_s=max(r["start_s"] for r in reports),
                generate_s=max(r["generate_s"] for r in reports),
                batch_s=[max(t) for t in zip(*(r["batch_s"] for r in reports))],
                step_s=[max(t) for t in zip(*(r["step_s"] for r in reports))],
                workers=[w for r in reports for w in r["workers"]],
                worker_pids=[p for r in reports for p in r["worker_pids"]],
                compiled_ops=compiled_ops(cache_root, since))


if __name__ == "__main__":
    print("RESULT " + json.dumps(generate(json.loads(sys.argv[1]))), flush=True)
