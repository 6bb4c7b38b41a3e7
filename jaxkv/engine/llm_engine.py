"""LLMEngine: add_request / step / abort_request. Glue between the scheduler (host bookkeeping),
the model runner (device) and the output processor (text, stop checks, outputs)."""

from __future__ import annotations

import logging
import time

import numpy as np

from jaxkv.engine_args import EngineArgs
from jaxkv.engine_config import EngineConfig
from jaxkv.core.core_output import EngineCoreOutput, core_output
from jaxkv.engine.core_request import EngineCoreRequest
from jaxkv.engine.output_processor import OutputProcessor
from jaxkv.core.disk_tier import CorruptBlockError
from jaxkv.core.request import Request, RequestStatus
from jaxkv.engine.stats import EngineStats, moe_stats, spec_stats, tier_stats
from jaxkv.outputs import RequestOutput
from jaxkv.sampling.params import SamplingParams

logger = logging.getLogger("jaxkv")


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Token id sequences of `words` as vLLM tokenizes bad_words: each word as given and with
    one leading space (when that gives another first token and as many tokens), no special
    tokens; duplicates dropped."""
    out: list[list[int]] = []
    for word in words:
        try:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        except (TypeError, UnicodeError) as e:  # e.g. a lone surrogate
            raise ValueError(f"bad_words: {word!r} cannot be encoded ({type(e).__name__})"[:300]) from e
        if not plain:
            raise ValueError(f"bad_words: {word!r} encodes to no tokens")
        for ids in (plain, spaced):
            if ids and ids not in out and (ids is plain or (ids[0] != plain[0] and len(ids) == len(plain))):
                out.append(ids)
    return out


def child_request_id(request_id: str, index: int, n: int) -> str:
    """Internal id of sample `index` of a request with n samples (vLLM's f"{index}_{id}")."""
    return request_id if n == 1 else f"{index}_{request_id}"


class LLMEngine:
    """Build with `LLMEngine.from_engine_args(EngineArgs(...))` (see jaxkv.engine.setup)."""

    def __init__(self, config: EngineConfig, tokenizer, scheduler, runner):
        """config: the resolved EngineConfig; scheduler: a Scheduler over the KV cache manager,
        with the StructuredOutputManager of this tokenizer, which the engine uses too;
        runner: a ModelRunner (or anything with its execute / recover_kv_cache)."""
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.runner = runner
        self.max_model_len = config.max_model_len
        self.output_processor = OutputProcessor(tokenizer, self.max_model_len)
        self.eos_token_ids = tuple(self.model_config.eos_token_ids)
        self._seed_rng = np.random.default_rng(config.seed)
        self.num_prompt_tokens = 0
        self.num_steps = 0  # steps that ran a batch, and the engine thread's CPU seconds in
        self.host_cpu_seconds = 0.0  # engine_core_step (the host's work: waits cost none)
        self._pending_outputs: list[RequestOutput] = []  # made by a step that then raised
        if scheduler.structured_output_manager is None:
            raise ValueError("LLMEngine needs a Scheduler built with a StructuredOutputManager "
                             "(jaxkv.core.grammar) of this tokenizer")
        self.structured_output_manager = scheduler.structured_output_manager

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        from jaxkv.engine.setup import build_engine
        return build_engine(cls, args)

    @property
    def num_generation_tokens(self) -> int:
        """Output tokens handed out so far (none past a stop string)."""
        return self.output_processor.num_generation_tokens

    # ---- intake -------------------------------------------------------------------------
    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """str | {"prompt": str} | {"prompt_token_ids": [...]} | a list of token ids -> (text,
        ids). ValueError if bad."""
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            return None, list(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string or a dict, got {type(prompt).__name__}")
        try:
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        except (TypeError, UnicodeError) as e:  # e.g. a lone surrogate in the text
            raise ValueError(f"prompt: the text cannot be encoded ({type(e).__name__}: {e})"[:300]) from e

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request. Raises ValueError (naming the value) for an empty prompt, token ids
        outside the vocabulary, logprobs above max_logprobs, a structured_outputs constraint
        that does not compile (structured_outputs.<kind>), or a request that can never fit
        (prompt + max_tokens > max_model_len, or more blocks than the whole pool); nothing is
        queued then."""
        self.add_processed(self.process_inputs(request_id, prompt, params), arrival_time)

    def process_inputs(self, request_id: str, prompt, params: SamplingParams | None = None
                       ) -> EngineCoreRequest:
        """Validate and tokenize one request without queueing it (ValueError naming the field
        when bad); the user's params are not changed."""
        params = (params or SamplingParams()).clone()
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        for name, given in (("logit_bias", list(params.logit_bias or ())),
                            ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in given if t >= vocab]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words) if params.bad_words else []
        grammar = None
        if params.structured_outputs is not None:  # checked here, compiled on the grammar pool
            so = getattr(self.config, "structured_outputs", None)
            if so is not None:
                params.structured_outputs = so.apply(params.structured_outputs)
            grammar = self.structured_output_manager.grammar(params.structured_outputs)
        params.top_k = min(params.top_k, vocab)  # as vLLM: top_k above the vocabulary keeps all
        max_logprobs = self.config.runner.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > max_logprobs:
                raise ValueError(f"{name}: requested {v}, more than max_logprobs={max_logprobs}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt length ({len(ids)} tokens) must be shorter than max_model_len "
                             f"({self.max_model_len}) to leave room for at least one new token")
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(ids)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{len(ids) + params.max_tokens} exceeds max_model_len ({self.max_model_len})")
        kv = self.scheduler.kv
        need = kv.blocks_to_hold(len(ids) + params.max_tokens,
                                 self.config.scheduler.max_num_batched_tokens)
        if need > kv.num_total_blocks:
            raise ValueError(f"request needs {need} blocks ({len(ids)} prompt + {params.max_tokens} "
                             f"max_tokens), but the KV cache has only {kv.num_total_blocks}")
        self._check_request_id(request_id, params.n)
        return EngineCoreRequest(request_id, text, ids, params, bad_words, grammar)

    def _check_request_id(self, request_id: str, n: int) -> None:
        """ValueError unless `request_id` and the ids of its n samples are all free: a user
        id may not equal another request's sample id ("0_x" next to "x" with n > 1), nor the
        other way round."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        op = self.output_processor
        in_use = lambda rid: rid in op.groups or rid in op.samples or rid in self.scheduler.requests  # noqa: E731
        for rid in [request_id] + [child_request_id(request_id, j, n) for j in range(n)]:
            if in_use(rid):
                what = "" if rid == request_id else f" (the id of its sample {rid!r} is taken)"
                raise ValueError(f"request_id {request_id!r} is already in use{what}")

    def add_processed(self, request: EngineCoreRequest, arrival_time=None) -> None:
        """Queue a request already checked by process_inputs. ValueError (nothing queued) if
        its id or a sample's id was taken since."""
        request_id, text, ids = request.request_id, request.prompt, request.prompt_token_ids
        params = request.sampling_params
        self._check_request_id(request_id, params.n)
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**32))
        t = arrival_time or time.monotonic()
        children = []
        for j in range(params.n):
            rid = child_request_id(request_id, j, params.n)
            r = Request(rid, ids, params, self.eos_token_ids, seed, sample_index=j,
                        parent_id=request_id, prompt=text,
                        bad_words_token_ids=request.bad_words_token_ids)
            if request.grammar is not None:
                r.grammar = self.structured_output_manager.new_state(request.grammar)
            r.times.arrival_time = t
            children.append(r)
        self.output_processor.add_group(request_id, text, children)
        self.scheduler.add_request(children[0], children[1:])
        self.num_prompt_tokens += len(ids)

    # ---- the loop -----------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or outputs of a step that raised are still
        to be returned by step()."""
        return self.scheduler.has_unfinished_requests() or bool(self._pending_outputs)

    def step(self) -> list[RequestOutput]:
        """Schedule, run one jitted step, sample, and return this step's outputs (shaped by
        each request's output_kind): engine_core_step, then process_outputs.

        If scheduling or the runner raises (an XLA error, KeyboardInterrupt), the step is
        undone before the error propagates: nothing it registered in the prefix cache
        survives, its requests are requeued to recompute, and if the KV pool itself was lost
        every request recomputes. The engine stays usable (call step() again, or abort). A
        damaged disk-tier block file is the exception that does not propagate: the step is
        undone the same way and the next one computes those blocks instead."""
        outputs = self.process_outputs(self.engine_core_step())
        return self.take_pending_outputs() + outputs  # older ones first

    def take_pending_outputs(self) -> list[RequestOutput]:
        """The RequestOutputs held back from a step whose output processing raised (see
        process_outputs), handed over once."""
        pending, self._pending_outputs = self._pending_outputs, []
        return pending

    def engine_core_step(self) -> list[EngineCoreOutput]:
        """The engine's part of a step (vLLM V1's EngineCore.step): schedule, run, and
        apply the sampled tokens and token-level stops; returns what it did to each
        sequence, for the output processor (on this thread or another one). Its thread's
        CPU time adds to host_cpu_seconds."""
        t0 = time.thread_time()
        try:
            return self._core_step()
        finally:
            self.host_cpu_seconds += time.thread_time() - t0

    def _core_step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler
        try:  # schedule -> execute_model -> update_from_output
            # (Async scheduling: the sequences of a step run ahead take its results; new
            # prompts run beside it, jaxkv/runner/lookahead.py.)
            out = sched.schedule()
            if not out.scheduled:
                if out.kv_transfers:  # a swap-out with nothing to run: copy it all the same
                    self.runner.execute(out)
                return []
            res = self.runner.execute(out)
            self.num_steps += 1
        except CorruptBlockError as e:  # a damaged disk-tier file (deleted): compute it again
            self._undo_failed_step()
            logger.warning("%s; its requests compute those blocks again", e)
            return []
        except BaseException:
            self._undo_failed_step()
            raise
        return sched.update_from_output(out, res)

    def process_outputs(self, core: list[EngineCoreOutput], every_sample: bool = False) -> list[RequestOutput]:
        """RequestOutputs of `core` (OutputProcessor.process), on this thread; the sequences
        a stop string ended are finished in the engine at once (stop_requests).

        An error (or Ctrl-C) while one request's text is processed does not lose the others:
        every output is processed, the RequestOutputs are kept for the next step() to return,
        and the first error is raised at the end."""
        outputs, stops, error = self.output_processor.process(core, every_sample)
        self.stop_requests(stops)
        if error is not None:
            self._pending_outputs += outputs
            raise error
        return outputs

    def stop_requests(self, stops) -> None:
        """Finish in the engine the sequences the output processor found a stop string in:
        (request id, sequence id, stop string, output tokens kept) each; tokens sampled after
        it are dropped and the blocks freed. Sequences already finished are skipped."""
        for _, rid, stop_str, keep in stops:
            req = self.scheduler.requests.get(rid)
            if req is not None:
                req.truncate_output(keep)
                req.stop_reason = stop_str
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)

    def _undo_failed_step(self) -> None:
        try:
            lost = self.runner.recover_kv_cache()
        finally:
            n = self.scheduler.undo_step()
        if lost:
            self.scheduler.drop_all_kv()
        logger.warning("a step failed and was undone: %d request(s) requeued to recompute%s", n,
                       "; the KV cache was lost and reallocated, every request recomputes"
                       if lost else "")

    def abort_request(self, request_ids) -> list[RequestOutput]:
        """Abort requests (user ids, all n samples); their blocks are freed at once.
        Returns their final RequestOutputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        gone = set(request_ids)  # outputs held back from a failed step are superseded
        self._pending_outputs = [o for o in self._pending_outputs if o.request_id not in gone]
        return self.process_outputs(self.abort_core(request_ids, orphans=True), every_sample=True)

    def abort_core(self, request_ids: list[str], orphans: bool = False) -> list[EngineCoreOutput]:
        """The engine's part of an abort: finish the samples of `request_ids` (user ids;
        unknown ones skipped) that still run, freeing their blocks; a finished
        EngineCoreOutput for each. `orphans`: one too for each sample the engine no longer
        holds whose output is not finished (output processing raised before it saw the
        finish); only where the output processor runs right after, on this thread (an
        output thread could see it after a new request took the id)."""
        core, now = [], time.monotonic()
        for rid in request_ids:
            g = self.output_processor.groups.get(rid)
            for s in g.samples if g is not None else ():
                req = self.scheduler.requests.get(s.request_id)
                if req is not None:
                    self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                    core.append(core_output(req, []))
                elif orphans and s.finished is None:
                    core.append(EngineCoreOutput(s.request_id, [], finished=RequestStatus.FINISHED_ABORTED,
                                                 finished_time=now))
        return core

    # ---- introspection ------------------------------------------------------------------
    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash. As vLLM, refused (False, nothing dropped) while
        any request holds blocks; True once done."""
        return self.scheduler.reset_prefix_cache()

    def wait_for_background_compile(self, timeout: float | None = None) -> bool:
        """Block until the background compiler has ended (finished, stopped or failed) or
        `timeout` seconds passed (None: no limit); True when every token bucket is then
        compiled. For measurements of the steady state: benchmarks call it before timing."""
        bg = getattr(self.runner, "background", None)
        if bg is not None:
            bg.wait(timeout)
        compiled = getattr(self.runner, "compiled_token_buckets", ())
        return set(compiled) >= set(self.config.runner.token_buckets)

    def shutdown(self) -> None:
        """Stop the background compile of token buckets (after the program in flight). The
        engine stays usable: its steps keep to the buckets compiled so far."""
        stop = getattr(self.runner, "shutdown", None)  # a test's fake runner has none
        if stop is not None:
            stop()

    def stats(self) -> EngineStats:
        kv = self.scheduler.kv
        return EngineStats(
            num_total_blocks=kv.num_total_blocks, num_free_blocks=kv.num_free_blocks,
            kv_cache_usage=1.0 - kv.num_free_blocks / kv.num_total_blocks,
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            num_prompt_tokens=self.num_prompt_tokens,
            num_computed_prompt_tokens=self.scheduler.num_computed_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            output_cpu_seconds=self.output_processor.cpu_seconds,
            num_preemptions=self.scheduler.num_preemptions,
            num_compilations=self.runner.num_compilations,
            tensor_parallel_size=self.config.runner.tensor_parallel_size,
            num_processes=self.config.runner.num_processes,
            attention_backend=self.config.runner.attention_backend,
            quantization=(self.config.runner.quantization.name
                          if self.config.runner.quantization else None),
            weights_bytes=getattr(self.runner, "weights_bytes", 0),
            kv_sliding_window=kv.sliding_window, num_window_freed_blocks=kv.num_window_freed_blocks,
            num_steps=self.num_steps, host_cpu_seconds=self.host_cpu_seconds,
            cpu_matmul_max_rows=self.runner.cpu_matmul_max_rows,
            fused_sampling_max_tokens=getattr(self.runner, "fused_sampling_max_tokens", 0),
            num_fused_sampling_steps=getattr(self.runner, "num_fused_sampling_steps", 0),
            async_scheduling=getattr(self.runner, "async_scheduling", False),
            num_async_steps=getattr(self.runner, "num_ahead_dispatched", 0),
            num_async_steps_used=getattr(self.runner, "num_ahead_used", 0),
            num_async_steps_discarded=getattr(self.runner, "num_ahead_discarded", 0),
            num_async_steps_steady=getattr(self.runner, "num_ahead_steady", 0),
            num_launched_steps=getattr(getattr(self.runner, "launcher", None), "num_launched", 0),
            num_scheduler_steps=self.config.scheduler.num_scheduler_steps,
            num_multi_steps=getattr(getattr(self.runner, "multi_step", None), "num_steps_run", 0),
            token_buckets=self.config.runner.token_buckets,
            compiled_token_buckets=self.runner.compiled_token_buckets,
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_structured_output_requests=self.structured_output_manager.num_requests,
            num_grammars_compiled=self.structured_output_manager.num_compiled,
            grammar_compile_seconds=self.structured_output_manager.compile_seconds,
            **tier_stats(self.scheduler), **spec_stats(self.scheduler), **moe_stats(self.runner))
