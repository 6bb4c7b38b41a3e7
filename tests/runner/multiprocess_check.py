"""Multi-process runs (jax.distributed, gloo CPU collectives; two forced host devices per
process): `python -m tests.runner.multiprocess_check CASE PROCESS_ID PORT` prints one JSON line
on process 0, for tests/runner/test_multiprocess.py.

one: one process, four devices, TP 4 (the reference). two: process PROCESS_ID of two, two
devices each, TP 4 over the four. Both serve the same prompts greedily, then with seeds.
"""

from __future__ import annotations

import json
import os
import sys

from tests.runner.tp_check import ENGINE, TINY, tiny_folder_with_weights  # noqa: E402 (sets 4 devices)

CASE, PID, PORT = sys.argv[1], int(sys.argv[2]), sys.argv[3]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=" + ("4" if CASE == "one" else "2")


def main() -> dict:
    from jaxkv import LLM, SamplingParams
    dist = {} if CASE == "one" else dict(num_processes=2, process_id=PID,
                                         distributed_coordinator=f"127.0.0.1:{PORT}",
                                         distributed_timeout=120)
    llm = LLM(model=sys.argv[4], tensor_parallel_size=4, **ENGINE, **dist)
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + 7 * i))} for i in range(6)]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                  logprobs=2), use_tqdm=False)
    seeded = llm.generate(prompts[:3], SamplingParams(temperature=0.9, seed=7, max_tokens=8,
                                                      ignore_eos=True, n=2), use_tqdm=False)
    s = llm.stats()
    second = None
    try:  # the processes serve one engine for their lifetime
        LLM(model=sys.argv[4], tensor_parallel_size=4, **ENGINE, **dist)
    except ValueError as e:
        second = str(e)
    return {"second_engine": second,"greedy": [o.outputs[0].token_ids for o in greedy],
            "logprobs": [[{str(t): lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]
                         for o in greedy],
            "seeded": [[c.token_ids for c in o.outputs] for o in seeded],
            "num_processes": s.num_processes, "tensor_parallel_size": s.tensor_parallel_size,
            "pool": str(llm.llm_engine.runner.kv_cache.k.sharding.spec),
            "local_devices": len(llm.llm_engine.runner.kv_cache.k.addressable_shards),
            "num_free_blocks": s.num_free_blocks, "num_total_blocks": s.num_total_blocks}


if __name__ == "__main__":
    if CASE == "folder":  # 4 KV heads: the pool splits over the four devices of both processes
        print(tiny_folder_with_weights(dict(TINY, num_key_value_heads=4)))
    else:
        print("MP_RESULT " + json.dumps(main()), flush=True)
