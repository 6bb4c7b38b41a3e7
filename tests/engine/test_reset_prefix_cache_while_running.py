"""reset_prefix_cache refuses (returns False, drops nothing) while a request holds blocks (an
"also" item handed with the cases of 2026-11-30)."""

from __future__ import annotations

from jaxkv import SamplingParams
from tests.engine.conftest import _unique_prompt


def test_reset_prefix_cache_is_refused_while_a_request_runs(llm):
    engine = llm.llm_engine
    engine.add_request("r", _unique_prompt(7, 40), SamplingParams(temperature=0, max_tokens=4))
    engine.step()
    assert llm.reset_prefix_cache() is False
    assert engine.scheduler.kv.pool.cached  # nothing was dropped
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache() is True and not engine.scheduler.kv.pool.cached
