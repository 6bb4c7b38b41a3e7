"""A picture of the KV block pool for the live cache page (`jaxkv serve`'s /dashboard).

Taken on the engine thread between steps (AsyncLLM.kv_cache_snapshot), never while the
scheduler changes the pool. Plain Python; a few thousand blocks cost well under a millisecond.
"""

from __future__ import annotations

# Block states, as the page colors them.
NULL, FREE, CACHED, IN_USE, SHARED = 0, 1, 2, 3, 4
STATE_NAMES = {NULL: "null", FREE: "free", CACHED: "cached", IN_USE: "in use", SHARED: "shared"}


def kv_cache_snapshot(engine) -> dict:
    """{"block_size", "kv_cache_dtype" (the pool's values' dtype), "bytes_per_token",
    "num_blocks" (the null block 0 included), "states": [int per block],
    "ref_cnts": [int per block], "counts": {state name: blocks}, "requests": [{"request_id",
    "status", "num_computed_tokens", "num_tokens", "block_ids"} for every request holding
    blocks], "stats": EngineStats as a dict}. free: no holder, no hash; cached: no holder,
    hashed (reusable by a prefix hit until evicted); in use: one holder; shared: several
    (prefix hits, n > 1 forks). free + cached = stats.num_free_blocks; in use + shared =
    num_total_blocks - num_free_blocks."""
    kv = engine.scheduler.kv
    states, refs = [], []
    for b in kv.pool.blocks:
        refs.append(b.ref_cnt)
        if b.block_id == 0:
            states.append(NULL)
        elif b.ref_cnt == 0:
            states.append(CACHED if b.block_hash is not None else FREE)
        else:
            states.append(SHARED if b.ref_cnt > 1 else IN_USE)
    requests = []
    for rid, blocks in kv.req_to_blocks.items():
        req = engine.scheduler.requests.get(rid)
        if req is None or not blocks:
            continue
        requests.append({"request_id": rid, "status": req.status.name.lower(),
                         "num_computed_tokens": req.num_computed_tokens,
                         "num_tokens": req.num_tokens, "block_ids": list(blocks)})
    cfg = engine.config
    return {"block_size": kv.block_size, "kv_cache_dtype": cfg.runner.kv_cache_dtype,
            "bytes_per_token": cfg.cache.budget.bytes_per_token, "num_blocks": len(states),
            "states": states, "ref_cnts": refs,
            "counts": {STATE_NAMES[s]: states.count(s) for s in STATE_NAMES},
            "requests": requests, "stats": engine.stats().to_dict()}
