"""One process of the disk-tier restart test (tests/engine/test_kv_tiers.py):
`python -m tests.engine.kv_disk_check DIR [KV_CACHE_DTYPE]` serves a 1,520-token prompt (a
1,500-token system prompt and a question) with the disk tier in DIR, then two other long
prompts that evict the first from the device (so its blocks reach the host tier, and through
it the disk), and prints one JSON line: the first prompt's greedy tokens, the prompt tokens
computed for it, and the disk tier's counters."""

from __future__ import annotations

import json
import sys

import numpy as np


def main(folder: str, kv_dtype: str) -> dict:
    from jaxkv import LLM, SamplingParams
    llm = LLM(max_model_len=2048, max_num_batched_tokens=256, token_buckets=(8, 64, 256),
              max_num_seqs=8, num_gpu_blocks_override=100, swap_space=0.05,
              kv_cache_disk_dir=folder, kv_cache_disk_bytes="256MiB", kv_cache_dtype=kv_dtype)
    rng = np.random.default_rng(0)
    system = rng.integers(200, 20000, 1500).tolist()
    prompt = system + rng.integers(200, 20000, 20).tolist()
    others = [rng.integers(200, 20000, 1500).tolist() for _ in range(2)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    before = llm.stats().num_computed_prompt_tokens
    out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0]
    computed = llm.stats().num_computed_prompt_tokens - before
    hits = llm.stats().kv_offload_disk_hit_tokens
    for other in others:  # together they evict every block of the first prompt
        llm.generate({"prompt_token_ids": other}, sp, use_tqdm=False)
    s = llm.stats()
    return {"tokens": out.token_ids,
            "logprobs": [{str(t): lp.logprob for t, lp in d.items()} for d in out.logprobs],
            "computed": computed, "disk_hit_tokens": hits, "prompt": prompt,
            "disk_dir": llm.llm_engine.scheduler.kv.disk.dir,
            "disk_stored_blocks": s.kv_offload_disk_stored_blocks,
            "free_blocks": s.num_free_blocks, "total_blocks": s.num_total_blocks}


if __name__ == "__main__":
    print("DISK_RESULT " + json.dumps(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "auto")),
          flush=True)
