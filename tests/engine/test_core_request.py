"""LLMEngine.process_inputs hands back an EngineCoreRequest (vLLM's name) holding what the engine
derives from a request (bad_words as token ids, the constraint's grammar), and stores nothing on
SamplingParams: neither on the user's object nor on the engine's clone of it."""

import copy
import dataclasses

from jaxkv import SamplingParams, StructuredOutputsParams
from jaxkv.engine.core_request import EngineCoreRequest
from jaxkv.engine.llm_engine import bad_words_token_ids

FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def test_derived_data_travels_in_the_record_not_in_sampling_params(llm):
    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=4, bad_words=["Paris"],
                        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    before = copy.deepcopy(vars(sp))
    req = engine.process_inputs("core-request-1", "The capital of France is", sp)
    assert isinstance(req, EngineCoreRequest) and req.request_id == "core-request-1"
    assert vars(sp) == before                       # the user's object is untouched
    assert req.sampling_params is not sp
    assert set(vars(req.sampling_params)) == FIELDS  # no attribute beyond its own fields
    assert req.bad_words_token_ids == bad_words_token_ids(engine.tokenizer, ["Paris"])
    assert req.bad_words_token_ids and req.grammar
    assert req.prompt == "The capital of France is" and req.prompt_token_ids


def test_the_record_reaches_the_step(llm):
    """The bad words' ids get to the runner through the scheduler's ScheduledRequest."""
    engine = llm.llm_engine
    req = engine.process_inputs("core-request-2", "The capital of France is",
                                SamplingParams(max_tokens=2, bad_words=["Paris"], temperature=0))
    seen, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda *a, **k: (lambda out: seen.append(out) or out)(schedule(*a, **k))
    try:
        engine.add_processed(req)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.scheduler.schedule = schedule
    rows = [s for out in seen for s in out.scheduled if s.request_id == "core-request-2"]
    assert rows and all(s.bad_words_token_ids == req.bad_words_token_ids for s in rows)
