"""The offline API: `LLM(...).generate(prompts)` and `.chat(messages)`, as vLLM's LLM class."""

from __future__ import annotations

import itertools
import logging

from jaxkv.chat_utils import render_chat
from jaxkv.engine_args import EngineArgs
from jaxkv.engine.gc_heap import frozen_heap
from jaxkv.engine.output_pipeline import OutputPipeline
from jaxkv.engine.llm_engine import LLMEngine
from jaxkv.logger import setup_logging
from jaxkv.outputs import RequestOutput
from jaxkv.sampling.params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jaxkv")


class LLM:
    """An engine plus a blocking generate loop. Keyword arguments are EngineArgs fields (vLLM's
    names); ValueError names a bad field."""

    def __init__(self, model: str | None = None, *, engine_args: EngineArgs | None = None, **kwargs):
        setup_logging()
        args = engine_args if engine_args is not None else EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(args)
        self._counter = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLM":
        return cls(engine_args=args)

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def stats(self):
        return self.llm_engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (nothing dropped) while requests hold blocks."""
        return self.llm_engine.reset_prefix_cache()

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: str | {"prompt_token_ids": [...]} | a list of those; sampling_params: one
        SamplingParams or one per prompt. Returns finished RequestOutputs in input order.

        Every prompt is validated before any is queued: one bad prompt (bad token ids, too
        long for max_model_len, more blocks than the whole KV pool, a bad parameter) raises
        ValueError naming it and the whole call runs nothing, so nothing is lost or half
        done. (vLLM's server answers such a request alone with 400; jaxkv's server does the
        same, since each HTTP request is validated on its own.)"""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        return self._run(prompts, params, use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template: str | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """messages: one conversation (list of {"role", "content"}) or a list of them; the
        model's chat template (or `chat_template`, a Jinja string) is applied as transformers'
        apply_chat_template does, with vLLM's add_generation_prompt / continue_final_message /
        chat_template_kwargs. Text typed in a message is never encoded as a control token
        (jaxkv.chat_utils). ValueError names a bad message field; nothing is queued then."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        prompts = []
        for c in convs:
            text, ids = render_chat(tok, c, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, prompts, params, use_tqdm) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [str(next(self._counter)) for _ in prompts]
        checked = []
        for rid, p, sp in zip(ids, prompts, params):  # validate all before queueing any
            sp = sp.clone()
            sp.output_kind = RequestOutputKind.FINAL_ONLY
            checked.append(engine.process_inputs(rid, p, sp))
        for c in checked:
            engine.add_processed(c)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)

        def collect(outputs) -> None:  # (on the output thread)
            for o in outputs:
                if o.finished:
                    results[o.request_id] = o
                    if bar is not None:
                        bar.update(1)
        # Steps here, output processing on a thread beside them (output_pipeline.py).
        pipe, error = OutputPipeline(engine, collect), None
        try:
            with frozen_heap():  # full collections skip the heap from before (gc_heap.py)
                while engine.has_unfinished_requests():
                    pipe.step()
        finally:
            try:
                error = pipe.close()
            finally:
                if bar is not None:
                    bar.close()
                left = [r for r in ids if r not in results]
                if left:
                    engine.abort_request(left)
        if error is not None:
            raise error
        return [results[r] for r in ids]
