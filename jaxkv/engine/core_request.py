"""EngineCoreRequest: a request as `LLMEngine.process_inputs` checked it, ready to queue.

vLLM's name for the record its front end hands the engine core. It carries the user's
SamplingParams (a clone: max_tokens resolved, top_k capped at the vocabulary, the server's
structured-output defaults applied) and what the engine derived from them, so that nothing is
stored on the user's SamplingParams.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxkv.sampling.params import SamplingParams


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt: str | None                # the prompt's text; None when it came as token ids
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # bad_words as token id sequences (vLLM's rule: each word alone and with a leading space)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    grammar: str | None = None        # the structured-output constraint as llguidance grammar text
