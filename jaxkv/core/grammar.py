"""Structured outputs on the host: grammars compiled off the step loop, one matcher per
sequence, and the allowed-token bitmask of each step's rows (plain Python + numpy + llguidance).

As vLLM V1's StructuredOutputManager with its ``guidance`` backend: a request's grammar is
checked at the edge (`StructuredOutputManager.grammar`, cached by the constraint), its matcher
(an ``llguidance.LLMatcher``) is built in a thread pool, and the scheduler admits the request
only once the matcher is ready (vLLM's WAITING_FOR_FSM), so a slow grammar never stalls the
others. Every step the scheduler fills the bitmask of each constrained row that samples
(`fill_bitmasks`: bit t of word t // 32 set = token t allowed, int32 [rows, ceil(V / 32)]),
and every token the step appends is consumed by the matcher (`GrammarState.accept`). EOS is in
the mask only where the grammar may end. A constrained request gets no speculative drafts.

Preemption and prefix caching do not touch a matcher: it holds the output tokens, which
recompute keeps. n > 1 samples each have their own matcher.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import numpy as np

logger = logging.getLogger("jaxkv")


class GrammarState:
    """One sequence's matcher: not ready until its compile finished (`ready`)."""

    def __init__(self, future: Future):
        self._future = future
        self.matcher = None
        self.error: str | None = None

    @property
    def ready(self) -> bool:
        """True once the matcher is built (or its build failed: `error` says why)."""
        if self.matcher is None and self.error is None and self._future.done():
            try:
                self.matcher = self._future.result()
            except Exception as e:  # noqa: BLE001 - reported on the request
                self.error = f"{type(e).__name__}: {e}"[:300]
        return self.matcher is not None or self.error is not None

    def accept(self, token: int) -> bool:
        """Advance the matcher over one sampled token; False (and the matcher is done) when
        the grammar refuses it or its build failed: the request ends with an error, as vLLM
        ends it ("grammar rejected tokens"). The mask makes this rare: a grammar that needs an
        added token spelled as text, or a min_tokens ban or allowed_token_ids that leave no
        token the grammar allows."""
        if self.matcher is None:
            logger.warning("structured output: no matcher (%s); the request ends", self.error)
            return False
        if self.matcher.is_error() or not self.matcher.consume_token(int(token)):
            logger.warning("structured output: token %d not allowed by the grammar (%s); the "
                           "request ends", token, " ".join(self.matcher.get_error().split())[:200])
            return False
        return True

    def release(self) -> None:
        self._future.cancel()
        self.matcher = None


class StructuredOutputManager:
    """Grammars for one engine: its tokenizer (wrapped for llguidance once, on first use, about
    0.5 s), a cache of validated grammar texts, and the compile thread pool.

    tokenizer: a transformers fast tokenizer; vocab_size: the model's logits width (>= the
    tokenizer's); eos_token_ids: the model's EOS ids (allowed where the grammar may end)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, max_workers: int = 2):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.bitmask_words = -(-vocab_size // 32)
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._grammars: dict[str, str] = {}
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="jaxkv-grammar")
        self.num_requests = 0  # constrained sequences added (each n > 1 sample counts)
        self.num_compiled = 0  # matchers built
        self.compile_seconds = 0.0  # their total build time (on the pool's threads)

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf
                n = max(self.vocab_size, len(self.tokenizer))
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=n, eos_token=self.eos_token_ids or None)
            return self._ll_tokenizer

    def grammar(self, params) -> str:
        """The llguidance grammar of a StructuredOutputsParams, validated against this
        tokenizer (cached by the constraint). ValueError naming the field if it is bad."""
        key = params.cache_key()
        g = self._grammars.get(key)
        if g is None:
            g = params.validate(self.ll_tokenizer)
            with self._lock:
                if len(self._grammars) >= 1024:  # a bounded cache: forget the oldest
                    self._grammars.pop(next(iter(self._grammars)))
                self._grammars[key] = g
        return g

    def new_state(self, grammar: str) -> GrammarState:
        """A GrammarState whose matcher compiles on the pool."""
        self.num_requests += 1
        return GrammarState(self._pool.submit(self._build, grammar))

    def _build(self, grammar: str):
        import llguidance
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(self.ll_tokenizer, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        # The first mask builds the lexer: do it here, not on the step loop.
        mask = np.zeros((1, self._ll_words()), np.int32)
        _fill(m, mask, 0)
        with self._lock:
            self.compile_seconds += time.perf_counter() - t0
            self.num_compiled += 1
        return m

    def _ll_words(self) -> int:
        return -(-self.ll_tokenizer.vocab_size // 32)

    def attach_bitmasks(self, rows: list) -> None:
        """rows: (ScheduledRequest, its GrammarState) pairs; each gets its allowed-token row
        as `grammar_bitmask`."""
        for (s, _), m in zip(rows, self.fill_bitmasks([g for _, g in rows])):
            s.grammar_bitmask = m

    def fill_bitmasks(self, states: list[GrammarState]) -> np.ndarray:
        """int32 [len(states), ceil(vocab_size / 32)]: row i allows the tokens state i's
        matcher allows next (all bits set for a state whose build failed)."""
        w = self._ll_words()
        out = np.full((len(states), w), -1, np.int32)
        for i, st in enumerate(states):
            if st.matcher is not None:
                _fill(st.matcher, out, i)
        if w >= self.bitmask_words:
            return np.ascontiguousarray(out[:, :self.bitmask_words])
        return np.pad(out, ((0, 0), (0, self.bitmask_words - w)))


def wait_for_any(states: list[GrammarState], timeout: float) -> None:
    """Block until one of the states' compiles finishes, or `timeout` seconds pass."""
    wait([st._future for st in states], timeout=timeout, return_when=FIRST_COMPLETED)


def _fill(matcher, mask: np.ndarray, row: int) -> None:
    import llguidance.numpy
    llguidance.numpy.fill_next_token_bitmask(matcher, mask, row)
