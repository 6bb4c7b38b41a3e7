"""A pool too small for every request at once: requests are preempted by recompute, all finish,
and their greedy outputs equal those of an ample pool; no block leaks."""

import numpy as np
import pytest

from jaxkv import LLM, SamplingParams
from tests.conftest import TEST_ENGINE
from tests.helpers import assert_same_or_near_tie, margins_from_logprobs


@pytest.fixture(scope="module")
def small_pool():
    args = dict(TEST_ENGINE, kv_cache_memory_bytes=None, num_gpu_blocks_override=40)
    return LLM(**args)


def workload():
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(200, 20000, int(rng.integers(10, 120))).tolist()}
               for _ in range(16)]
    params = [SamplingParams(temperature=0, max_tokens=int(rng.integers(8, 48)), ignore_eos=True,
                             logprobs=2) for _ in range(16)]
    return prompts, params


def preempted_like_ample(llm, small_pool, prompts, params, what):
    """Run the workload on the ample pool and on the small one: the small one preempts, ends
    with every block free, and its greedy outputs are the ample pool's (near-ties aside).
    Returns the small pool's outputs."""
    ref = llm.generate(prompts, params, use_tqdm=False)
    before = small_pool.stats().num_preemptions
    got = small_pool.generate(prompts, params, use_tqdm=False)
    s = small_pool.stats()
    assert s.num_preemptions > before
    assert s.num_free_blocks == s.num_total_blocks and s.num_running == s.num_waiting == 0
    for a, b in zip(got, ref):
        assert_same_or_near_tie(a.outputs[0].token_ids, b.outputs[0].token_ids,
                                margins_from_logprobs(b.outputs[0].logprobs), what=what)
    return got


def test_preemption_keeps_outputs(llm, small_pool):
    prompts, params = workload()
    assert small_pool.stats().num_total_blocks == 39
    need = sum(-(-(len(p["prompt_token_ids"]) + sp.max_tokens) // 16) for p, sp in zip(prompts, params))
    assert need > 39  # the pool cannot hold them all at once
    got = preempted_like_ample(llm, small_pool, prompts, params, "preempted vs ample")
    for a, sp in zip(got, params):
        assert len(a.outputs[0].token_ids) == sp.max_tokens


def test_request_that_can_never_fit_is_rejected(small_pool):
    with pytest.raises(ValueError, match="blocks"):
        small_pool.generate({"prompt_token_ids": [5] * 600}, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="max_model_len"):
        small_pool.generate({"prompt_token_ids": [5] * 1000}, SamplingParams(max_tokens=100))
    s = small_pool.stats()
    assert s.num_free_blocks == s.num_total_blocks and s.num_waiting == 0


def test_preemption_keeps_structured_outputs(llm, small_pool):
    """Constrained requests preempted by recompute keep their matcher in step: the same greedy
    JSON as in an ample pool, and every block comes back."""
    import json

    from jaxkv import StructuredOutputsParams

    so = StructuredOutputsParams(json={"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                  "minItems": 30, "maxItems": 40}}, "required": ["items"]}, disable_any_whitespace=True)
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(200, 20000, 100).tolist()} for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=160, logprobs=2, structured_outputs=so)
    for a in preempted_like_ample(llm, small_pool, prompts, params, "preempted JSON"):
        if a.outputs[0].finish_reason == "stop":
            assert 30 <= len(json.loads(a.outputs[0].text)["items"]) <= 40
