"""Compilation is bounded: after warmup, a long mixed workload compiles nothing new."""

import numpy as np

from jaxkv import SamplingParams


def test_no_new_compilation_after_warmup(llm):
    eng = llm.llm_engine
    before = eng.stats().num_compilations
    assert before > 0
    rng = np.random.default_rng(3)
    for i in range(24):  # prompts from 3 to 300 tokens; greedy, random, top-k/top-p rows mixed
        n = int(rng.integers(3, 300))
        ids = rng.integers(100, 40000, n).tolist()
        kind = i % 3
        sp = SamplingParams(temperature=0.0 if kind == 0 else 0.9, top_p=0.8 if kind == 2 else 1.0,
                            top_k=20 if kind == 2 else 0, seed=i, ignore_eos=True,
                            max_tokens=int(rng.integers(1, 40)))
        eng.add_request(f"mix-{i}", {"prompt_token_ids": ids}, sp)
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    assert steps >= 50
    assert eng.stats().num_compilations == before
