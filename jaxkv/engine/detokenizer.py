"""Incremental detokenization and stop strings (host side, one object per output sequence).

Follows vLLM: incremental decoding with prefix_offset / read_offset windows and the v1
``IncrementalDetokenizer.update`` / ``get_next_output_text`` contract, including the held-back
tail that keeps a partial stop string out of streamed text.

Each new token is decoded together with a few tokens before it (the window
``tokens[prefix_offset:]``) and only the text past ``tokens[prefix_offset:read_offset]`` is
emitted. This gives the same text as decoding everything at once (leading-space rules of
some tokenizers depend on the previous token), at a cost independent of the output length.
When the window's text ends in U+FFFD, the last token ends inside a multi-byte UTF-8
character; nothing is emitted and the offsets stay put until a later token completes it.

For a Hugging Face fast tokenizer (the usual case) the window is the `tokenizers` library's
``DecodeStream``, which keeps exactly these offsets in Rust (``StreamDecoder``). Our own
window on token strings (``WindowDecoder``) stays for tokenizers without a Rust backend, for
a `tokenizers` whose DecodeStream takes no prefill ids, and for the cases DecodeStream would
decode differently (both in jaxkv/engine/incremental_decoders.py).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from jaxkv.engine.incremental_decoders import (REPLACEMENT_CHAR, StreamDecoder, WindowDecoder,
                                               ids_to_tokens, rust_backend)
from jaxkv.loader.gguf_tokenizer import byte_level_alphabet
from jaxkv.sampling.params import SamplingParams

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens kept as decoding context.
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5


def detokenize_token(tokenizer: Any, token_id: int) -> str:
    """The text of one token alone: the ``decoded_token`` of a vLLM Logprob entry.

    A token holding only part of a multi-byte character cannot be shown as text; it reads
    ``bytes:`` followed by its bytes as ``\\xNN`` escapes (``bytes:\\xe6\\x97``), as vLLM
    shows such tokens, so two fragments never share a text (a real U+FFFD stays itself).
    """
    tokens = ids_to_tokens(tokenizer, [token_id], skip_special_tokens=False)
    text = tokenizer.convert_tokens_to_string(tokens) if tokens and tokens[0] else ""
    if REPLACEMENT_CHAR in text:
        raw = token_bytes(tokenizer, token_id, tokens[0])
        if raw is not None and raw != text.encode():
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable character -> byte map (the inverse of the byte-level BPE alphabet)."""
    return {ch: b for b, ch in byte_level_alphabet().items()}


def token_bytes(tokenizer: Any, token_id: int, token: str | None = None) -> bytes | None:
    """The raw bytes of one token: from a byte-fallback piece (``<0xE6>``) or a byte-level
    BPE token (GPT-2's alphabet); None when the token is neither."""
    if token is None:
        token = (ids_to_tokens(tokenizer, [token_id], skip_special_tokens=False) or [""])[0]
    m = _BYTE_FALLBACK.fullmatch(token)
    if m:
        return bytes([int(m.group(1), 16)])
    table = _byte_level_decoder()
    if token and all(ch in table for ch in token):
        return bytes(table[ch] for ch in token)
    return None


def find_stop_string(
    text: str, new_char_count: int, stop: list[str]
) -> tuple[str, int] | None:
    """The stop string that ends first in ``text`` among those ending in its last
    ``new_char_count`` characters, with its start index; None when there is none.

    Only matches with at least one character in the new region are looked for: text before
    it was searched already. Of two matches ending at the same character, the one starting
    earlier (the longer) wins, so no piece of a stop string is left in the output.
    """
    if new_char_count <= 0 or not stop:
        return None
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for stop_str in stop:
        start = max(0, len(text) - new_char_count - len(stop_str) + 1)
        index = text.find(stop_str, start)
        if index == -1:
            continue
        candidate = (index + len(stop_str), index, stop_str)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    return None if best is None else (best[2], best[1])


class IncrementalDetokenizer:
    """Turns the output tokens of one sequence into text, a few tokens at a time.

    ``output_text`` is the full text so far (already cut at a stop string when one was
    found); ``get_next_output_text`` says what to hand to the caller now.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.spaces_between_special_tokens = params.spaces_between_special_tokens
        self.stop: list[str] = list(params.stop or [])
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        # Characters held back while streaming so a partial stop string is never emitted.
        if self.stop and not self.include_stop_str_in_output:
            self.stop_buffer_length = max(len(s) for s in self.stop) - 1
        else:
            self.stop_buffer_length = 0

        self.output_text = ""
        self.num_output_tokens = 0
        self._last_output_text_offset = 0
        self._decoder = self._make_decoder(list(prompt_token_ids))

    def _make_decoder(self, prompt_token_ids: list[int]) -> StreamDecoder | WindowDecoder:
        """Context: the last few prompt tokens (vLLM's convert_prompt_ids_to_tokens): of the
        last OFFSET + 2, those left after skipping, and of those the last OFFSET are decoded
        before the first output token (only their text is not emitted)."""
        tail = prompt_token_ids[-(INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET + 2):]
        backend = rust_backend(self.tokenizer)
        if backend is not None:
            vocab = len(self.tokenizer)
            skip = set(self.tokenizer.all_special_ids) if self.skip_special_tokens else set()
            context = [t for t in tail if t not in skip][-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET:]
            if (all(0 <= t < vocab for t in context)
                    and not backend.decode(context, skip_special_tokens=False).endswith(REPLACEMENT_CHAR)):
                return StreamDecoder(self.tokenizer, backend, context, vocab, skip, self.skip_special_tokens)
        tokens = ids_to_tokens(self.tokenizer, tail, self.skip_special_tokens)
        read_offset = len(tokens)
        prefix_offset = max(read_offset - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
        return WindowDecoder(self.tokenizer, tokens, prefix_offset, read_offset, self.skip_special_tokens,
                             self.spaces_between_special_tokens)

    def update(
        self,
        new_token_ids: list[int],
        num_output_tokens_before: int | None = None,
        *,
        stop_terminated: bool = False,
    ) -> str | None:
        """Add newly sampled tokens; return the stop string they complete, if any.

        ``num_output_tokens_before``: output tokens the sequence had before these (defaults
        to the count this object has seen); it decides when min_tokens is reached.
        ``stop_terminated``: the last token is EOS or one of stop_token_ids and ends the
        request; as in vLLM its text is left out unless include_stop_str_in_output.

        When a stop string is found, ``output_text`` is cut before it (after it with
        include_stop_str_in_output) and the caller should finish the request. Stop strings
        completed by the first min_tokens output tokens are ignored (vLLM's rule).
        """
        if not new_token_ids:
            return None
        before = self.num_output_tokens if num_output_tokens_before is None else num_output_tokens_before
        if not self.stop and not stop_terminated and len(new_token_ids) == 1:  # a decode step's
            self.output_text += self._decoder.step(new_token_ids[0])  # token, no stop strings
            self.num_output_tokens = before + 1
            return None
        to_decode = list(new_token_ids)
        if stop_terminated and not self.include_stop_str_in_output:
            to_decode = to_decode[:-1]

        stop_check_offset = len(self.output_text)
        for i, token_id in enumerate(to_decode):
            self.output_text += self._decoder.step(token_id)
            if before + i + 1 <= self.min_tokens:
                stop_check_offset = len(self.output_text)
        self.num_output_tokens = before + len(new_token_ids)

        if not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        found = find_stop_string(self.output_text, len(self.output_text) - stop_check_offset, self.stop)
        if found is None:
            return None
        stop_str, start = found
        end = start + len(stop_str) if self.include_stop_str_in_output else start
        self.output_text = self.output_text[:end]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to hand out now.

        delta=False: all of ``output_text``; delta=True: only what was not handed out
        before. Until ``finished``, the last (longest stop string - 1) characters are held
        back (when stop strings are excluded from the output), so that a stop string that is
        still being completed never reaches the caller.
        """
        buffer_length = 0 if finished else self.stop_buffer_length
        length = max(len(self.output_text) - buffer_length, 0)
        if not delta:
            return self.output_text[:length]
        last_offset = self._last_output_text_offset
        if last_offset < length:
            self._last_output_text_offset = length
            return self.output_text[last_offset:length]
        return ""
