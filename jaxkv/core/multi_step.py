"""Multi-step decode's scheduling (the runner's side: jaxkv/runner/multi_step.py): which
sequences of a step run several decode steps, and how many (plain Python, no JAX)."""

from __future__ import annotations

from jaxkv.core.request import Request


def multi_steps(chosen, kv, k: int, max_model_len: int) -> dict[str, int]:
    """Each chosen (Request, num_new_tokens) that decodes one token with plain sampling
    (`plain_decode`) gets up to `k` steps, within its max_tokens, max_model_len and the
    free blocks of KVCacheManager `kv` (its slots allocated here; one whose slots cannot be
    had keeps one step); the others (prompt chunks, sequences that need the host) one step,
    run beside them as a program of their own. Returns {request id: steps > 1}."""
    steps = {}
    for req, n in chosen:
        if n != 1 or not plain_decode(req):
            continue
        m = min(k, req.max_tokens - req.num_output_tokens, max_model_len - req.num_tokens)
        if m > 1 and kv.allocate_slots(req, m):
            steps[req.request_id] = m
    return steps


def plain_decode(req: Request) -> bool:
    """Whether `req` decodes its one known token and samples it from its logits alone (no
    logprobs, penalties, logits filters, min_tokens ban or grammar): the next steps' tokens
    are then sampled on the device."""
    sp = req.sampling_params
    return (req.num_computed_tokens + 1 == req.num_tokens and req.grammar is None
            and sp.logprobs is None and not sp.has_penalties and not sp.has_logits_filters
            and req.num_output_tokens >= sp.min_tokens)
