"""Speculative decoding on the host: its config, the n-gram proposer, and its counters.

Plain Python and numpy, no JAX. `SpeculativeConfig` takes vLLM's `speculative_config` dict
(method "ngram" only). `NgramProposer` is prompt lookup decoding (Saxena 2023; vLLM's "ngram"
method): the last n tokens of a sequence (n from prompt_lookup_max down to prompt_lookup_min)
are searched for earlier in its own tokens, prompt and output, and the tokens that followed
that occurrence are proposed. No match, no proposal: text the proposer cannot
predict is decoded as without speculation.

The scheduler gives a decoding request 1 + len(draft) tokens; the runner samples every one of
those positions and keeps the drafts up to the first position whose sampled token differs,
plus that sampled token (jaxkv.runner.model_runner). `SpecDecodingStats` counts what vLLM's
spec_decode_* metrics count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's SpeculativeConfig for method "ngram".

    num_speculative_tokens: most draft tokens per request per step (k, >= 1).
    prompt_lookup_max / prompt_lookup_min: the longest and shortest n-gram matched (>= 1,
    min <= max). As vLLM: neither given -> 5 and 5; one given -> the other takes its value.
    disable_by_batch_size: no drafts in a step while at least this many requests run (None:
    always draft). On a CPU a drafted decode computes 1 + k positions per sequence, and its
    attention cost grows with them: large batches decode faster without drafts.
    """
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    disable_by_batch_size: int | None = None

    @classmethod
    def from_value(cls, value) -> SpeculativeConfig | None:
        """From a dict, a JSON string (the CLI's --speculative-config), a SpeculativeConfig
        or None. ValueError naming the key and value for anything else."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e.msg}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or a JSON object, got {value!r}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "disable_by_batch_size"}
        stray = sorted(set(value) - known)
        if stray:
            raise ValueError(f"speculative_config: unknown key {stray[0]!r} (known: {sorted(known)})")
        method = value.get("method", "ngram")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {method!r}")
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                    "disable_by_batch_size"):
            v = value.get(key)
            if key == "num_speculative_tokens" and v is None:
                raise ValueError("speculative_config.num_speculative_tokens is required")
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"speculative_config.{key} must be a positive integer, got {v!r}")
        hi, lo = value.get("prompt_lookup_max"), value.get("prompt_lookup_min")
        if hi is None and lo is None:
            hi = lo = 5
        hi, lo = hi if hi is not None else lo, lo if lo is not None else hi
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= "
                             f"prompt_lookup_max ({hi})")
        return cls(method, value["num_speculative_tokens"], hi, lo, value.get("disable_by_batch_size"))

    def to_dict(self) -> dict:
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_max": self.prompt_lookup_max,
                "prompt_lookup_min": self.prompt_lookup_min,
                "disable_by_batch_size": self.disable_by_batch_size}


class NgramProposer:
    """propose(token_ids, k) -> up to k draft tokens (a list, empty when nothing matches)."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.n_max = config.prompt_lookup_max
        self.n_min = config.prompt_lookup_min
        self.disable_by_batch_size = config.disable_by_batch_size

    def propose(self, token_ids, k: int | None = None) -> list[int]:
        """Drafts for the sequence `token_ids` (prompt + output so far): the tokens after an
        earlier occurrence of its longest suffix n-gram (n_max >= n >= n_min; the latest one
        followed by k tokens, else the earliest), at most k (default: num_speculative_tokens).
        No Python loop over the history: one comparison finds the last token's occurrences,
        then each longer n-gram filters those candidates."""
        k = self.k if k is None else k
        toks = np.asarray(token_ids, dtype=np.int64)
        length = len(toks)
        if k <= 0 or length <= self.n_min:
            return []
        # Ends e (< length - 1) of earlier n-grams equal to the suffix, grown one token at a
        # time: one comparison over the history, then a few over the candidates.
        ends = np.flatnonzero(toks[:-1] == toks[-1])
        n, best = 1, (ends if self.n_min <= 1 else ends[:0])
        while len(ends) and n < self.n_max:
            ends = ends[ends >= n]
            ends = ends[toks[ends - n] == toks[length - 1 - n]]
            n += 1
            if len(ends) and n >= self.n_min:
                best = ends
        if not len(best):
            return []
        # The latest occurrence with k tokens after it; else the earliest (in a repeating
        # run the latest overlaps the suffix and has few tokens after it).
        full = best[best + 1 + k <= length]
        start = int(full[-1] if len(full) else best[0]) + 1
        return toks[start:start + k].tolist()


@dataclass
class SpecDecodingStats:
    """Cumulative counters, as vLLM's spec_decode_* metrics: drafts (requests given a
    proposal in a step), draft tokens, accepted tokens, and accepted tokens per position."""
    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.num_accepted_tokens_per_pos[j] += 1
