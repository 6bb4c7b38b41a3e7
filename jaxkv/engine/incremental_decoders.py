"""The incremental decoders behind IncrementalDetokenizer (jaxkv/engine/detokenizer.py).

Both keep vLLM's prefix_offset / read_offset window: each new token is decoded together with a
few tokens before it and only the text past ``tokens[prefix_offset:read_offset]`` is emitted
(nothing while the window's text ends in U+FFFD, a character still split).
``StreamDecoder`` is the `tokenizers` library's ``DecodeStream`` (the usual case: a Hugging
Face fast tokenizer); ``WindowDecoder`` is the same window on token strings, for tokenizers
without a Rust backend and for the cases where DecodeStream would decode differently.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


def ids_to_tokens(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool) -> list[str]:
    """Token strings for ids; out-of-vocabulary ids become "" (as vLLM)."""
    vocab = len(tokenizer)
    tokens: list[str] = []
    for token_id in token_ids:
        if not 0 <= token_id < vocab:
            tokens.append("")
            continue
        converted = tokenizer.convert_ids_to_tokens([token_id], skip_special_tokens=skip_special_tokens)
        tokens.extend("" if t is None else t for t in converted)
    return tokens


@lru_cache(maxsize=1)
def decode_stream_class() -> Any:
    """`tokenizers.decoders.DecodeStream` if it takes prefill ids (newer `tokenizers`), else None."""
    try:
        from tokenizers.decoders import DecodeStream

        DecodeStream([], skip_special_tokens=False)
    except (ImportError, TypeError):
        return None
    return DecodeStream


def rust_backend(tokenizer: Any) -> Tokenizer | None:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer whose token <-> text
    methods are the stock ones (so decoding ids in Rust gives what ``convert_ids_to_tokens`` +
    ``convert_tokens_to_string`` give); None for anything else."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer) or decode_stream_class() is None:
        return None
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - a duck-typed tokenizer without transformers
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or any(
        getattr(cls, name) is not getattr(PreTrainedTokenizerFast, name)
        for name in ("convert_ids_to_tokens", "convert_tokens_to_string")
    ):
        return None
    return backend


def tokens_to_string(tokenizer: Any, tokens: list[str], skip_special_tokens: bool,
                     spaces_between_special_tokens: bool = True) -> str:
    """Token strings -> text, as vLLM's detokenizer: a fast tokenizer (or one without added
    tokens) converts them at once; a slow one converts the runs between its added tokens apart
    and joins the pieces with a space when spaces_between_special_tokens (vLLM's
    _convert_tokens_to_string_with_added_encoders). So the flag changes text only with slow
    tokenizers, as in vLLM."""
    added = {} if getattr(tokenizer, "is_fast", True) else tokenizer.get_added_vocab()
    if not added:
        return tokenizer.convert_tokens_to_string(tokens)
    special = set(tokenizer.all_special_tokens) if skip_special_tokens else set()
    pieces, run = [], []
    for t in tokens:
        if t in special:
            continue
        if t in added:
            if run:
                pieces.append(tokenizer.convert_tokens_to_string(run))
                run = []
            pieces.append(t)
        else:
            run.append(t)
    if run:
        pieces.append(tokenizer.convert_tokens_to_string(run))
    return (" " if spaces_between_special_tokens else "").join(pieces)


class WindowDecoder:
    """vLLM's ``detokenize_incrementally`` on token strings: decode ``tokens[prefix_offset:]``,
    emit what lies past the text of ``tokens[prefix_offset:read_offset]``."""

    def __init__(self, tokenizer: Any, tokens: list[str], prefix_offset: int, read_offset: int,
                 skip_special_tokens: bool, spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.tokens = tokens
        self.prefix_offset = prefix_offset
        self.read_offset = read_offset

    def step(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is split)."""
        self.tokens.extend(ids_to_tokens(self.tokenizer, [token_id], self.skip_special_tokens))
        to_string = lambda toks: tokens_to_string(  # noqa: E731
            self.tokenizer, toks, self.skip_special_tokens, self.spaces_between_special_tokens)
        prefix_text = to_string(self.tokens[self.prefix_offset:self.read_offset])
        new_text = to_string(self.tokens[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return new_text[len(prefix_text):]


class StreamDecoder:
    """The same window through ``tokenizers.decoders.DecodeStream``: one Rust decode per token
    instead of a Python id -> token lookup and two decoder calls.

    DecodeStream keeps ``ids = tokens[prefix_offset:]``, the text of
    ``tokens[prefix_offset:read_offset]`` and ``read_offset - prefix_offset``, and emits what
    ``WindowDecoder`` emits, None where it emits "". Where the two would differ, ours is kept:

    - Skipping: ids are dropped here by transformers' rule (``all_special_ids``, what
      ``convert_ids_to_tokens(skip_special_tokens=True)`` drops) and the stream never skips.
      DecodeStream's own skip_special_tokens drops every added token marked special in the
      Rust vocabulary, a larger set for some tokenizers (17 control tokens against
      transformers' 3 for the GGUF SmolLM2), which would change the text.
    - An id past the vocabulary: our window holds it as "" (text with a decoder that joins
      tokens by spaces), the Rust decode drops it; from there on the sequence goes through
      ``WindowDecoder``, started from the stream's offsets (``ids`` / ``read`` mirror them).
    - DecodeStream raises when the window's text does not start with the previous text
      (decoders that strip or rewrite by position, e.g. a leading-space Strip; never
      byte-level BPE), where our window emits the text past the old text's length: the same
      switch to ``WindowDecoder``.
    - The prompt context is DecodeStream's prefill. If it holds an unknown id or its text
      ends in U+FFFD (the prompt ends inside a character, where DecodeStream would emit the
      whole window as new text), ``IncrementalDetokenizer`` uses ``WindowDecoder`` throughout.
    """

    def __init__(self, tokenizer: Any, backend: Tokenizer, context_ids: list[int], vocab: int,
                 skip: set[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.backend = backend
        self.vocab = vocab
        self.skip = skip
        self.skip_special_tokens = skip_special_tokens
        self.stream = decode_stream_class()(list(context_ids), skip_special_tokens=False)
        self.ids = list(context_ids)  # the stream's ids: tokens[prefix_offset:]
        self.read = len(self.ids)  # read_offset - prefix_offset
        self.window: WindowDecoder | None = None

    def step(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is split)."""
        if self.window is None:
            if token_id in self.skip:
                return ""
            if not 0 <= token_id < self.vocab:
                self._to_window()  # our window holds it as "" (see the class docstring)
            else:
                self.ids.append(token_id)
                try:
                    text = self.stream.step(self.backend, token_id)
                except Exception as e:  # DecodeStream's "Invalid prefix" (see the class docstring)
                    if "Invalid prefix" not in str(e):
                        raise
                    self.ids.pop()
                    self._to_window()
                else:
                    if text is None:
                        return ""
                    del self.ids[:self.read]
                    self.read = len(self.ids)
                    return text
        return self.window.step(token_id)

    def _to_window(self) -> None:
        """Continue in ``WindowDecoder`` from the stream's offsets."""
        tokens = ids_to_tokens(self.tokenizer, self.ids, skip_special_tokens=False)
        self.window = WindowDecoder(self.tokenizer, tokens, 0, self.read, self.skip_special_tokens)
