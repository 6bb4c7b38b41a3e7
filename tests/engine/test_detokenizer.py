"""IncrementalDetokenizer against a real byte-level BPE tokenizer (SmolLM2)."""

import random

import pytest

from jaxkv.engine.detokenizer import IncrementalDetokenizer, detokenize_token, find_stop_string
from jaxkv.engine.incremental_decoders import StreamDecoder
from jaxkv.sampling.params import SamplingParams

TEXTS = [
    "🙂🚀👍🏽",
    "東京タワー",
    "café naïve résumé Ångström",
    "def f(x):\n\treturn x ** 2  # square",
    "  leading   and    many spaces  \n\n end ",
    "Hello 世界! 🙂 ñ — “quotes” and 1,234.5",
]


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _prompt(tok):
    return tok.apply_chat_template([{"role": "user", "content": "Say something."}],
                                   add_generation_prompt=True, tokenize=False)


def _stream(tok, prompt_ids, ids, params, chunk=1):
    """Feed ids `chunk` at a time; return (detok, stop, delta pieces, cumulative texts)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, params)
    deltas, texts, stop = [], [], None
    for i in range(0, len(ids), chunk):
        stop = detok.update(ids[i:i + chunk], i)
        texts.append(detok.output_text)
        finished = stop is not None or i + chunk >= len(ids)
        deltas.append(detok.get_next_output_text(finished=finished, delta=True))
        if stop is not None:
            break
    return detok, stop, deltas, texts


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("with_prompt", [False, True])
@pytest.mark.parametrize("chunk", [1, 3])
def test_round_trip_matches_decode(smollm2_hf_tokenizer, text, with_prompt, chunk):
    tok = smollm2_hf_tokenizer
    ids = _ids(tok, text)
    prompt_ids = tok.encode(_prompt(tok), add_special_tokens=False) if with_prompt else []
    detok, stop, deltas, texts = _stream(tok, prompt_ids, ids, SamplingParams(), chunk)
    assert stop is None
    assert detok.output_text == tok.decode(ids) == text
    assert "".join(deltas) == text
    for partial in texts:
        assert "\ufffd" not in partial
        assert text.startswith(partial)


def test_multibyte_character_is_held_back_until_complete(smollm2_hf_tokenizer):
    tok = smollm2_hf_tokenizer
    ids = _ids(tok, "🙂")
    assert len(ids) >= 2  # the emoji's bytes are split across tokens
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    for token_id in ids[:-1]:
        detok.update([token_id])
        assert detok.output_text == "" and detok.get_next_output_text(False, True) == ""
    detok.update(ids[-1:])
    assert detok.output_text == "🙂"


def _check_spans_tokens(tok, ids, stop):
    assert stop in tok.decode(ids)
    assert all(stop not in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("include, expected", [(False, "Hell"), (True, "Hello wor")])
def test_stop_string_across_tokens(smollm2_hf_tokenizer, include, expected):
    tok = smollm2_hf_tokenizer
    ids = _ids(tok, "Hello world, this is a test.")  # 'Hello', ' world', ...
    _check_spans_tokens(tok, ids, "o wor")
    params = SamplingParams(stop=["zzz", "o wor"], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tok, [], params)
    assert detok.update(ids[:1], 0) is None
    assert detok.update(ids[1:2], 1) == "o wor"
    assert detok.output_text == expected
    assert detok.get_next_output_text(finished=True, delta=False) == expected


@pytest.mark.parametrize("chunk", [1, 2, 4])
@pytest.mark.parametrize("stop", [", this is", "is a t", "test."])
def test_delta_stream_never_leaks_stop_prefix(smollm2_hf_tokenizer, chunk, stop):
    tok = smollm2_hf_tokenizer
    text = "Hello world, this is a test. More text after."
    ids = _ids(tok, text)
    final = text[: text.index(stop)]
    detok, found, deltas, _ = _stream(tok, [], ids, SamplingParams(stop=[stop]), chunk)
    assert found == stop and detok.output_text == final
    emitted = ""
    for piece in deltas:
        emitted += piece
        assert final.startswith(emitted)  # nothing of the stop string ever went out
    assert emitted == final


def test_cumulative_output_holds_back_tail(smollm2_hf_tokenizer):
    tok = smollm2_hf_tokenizer
    ids = _ids(tok, "Hello world foo bar")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["xyz!"]))
    detok.update(ids[:2])
    assert detok.output_text == "Hello world"
    assert detok.get_next_output_text(finished=False, delta=False) == "Hello wo"
    assert detok.get_next_output_text(finished=True, delta=False) == "Hello world"
    short = IncrementalDetokenizer(tok, [], SamplingParams(stop=["a much longer stop"]))
    short.update(ids[:1])
    assert short.get_next_output_text(finished=False, delta=False) == ""
    assert short.get_next_output_text(finished=False, delta=True) == ""


def test_include_stop_str_does_not_hold_back(smollm2_hf_tokenizer):
    tok = smollm2_hf_tokenizer
    ids = _ids(tok, "Hello world foo bar")
    params = SamplingParams(stop=["xyz!"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tok, [], params)
    detok.update(ids[:2])
    assert detok.get_next_output_text(finished=False, delta=True) == "Hello world"


def test_min_tokens_suppresses_stop_strings(smollm2_hf_tokenizer):
    tok = smollm2_hf_tokenizer
    ids = _ids(tok, "Hello world foo bar")  # 'Hello', ' world', ' foo', ' bar'
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["o"], min_tokens=2))
    assert detok.update(ids[:1], 0) is None
    assert detok.update(ids[1:2], 1) is None  # 'o' in ' world' ignored: only 2 tokens
    assert detok.update(ids[2:3], 2) == "o"
    assert detok.output_text == "Hello world f"
    # Same tokens in one chunk: the matches inside the first min_tokens are skipped too.
    chunked = IncrementalDetokenizer(tok, [], SamplingParams(stop=["o"], min_tokens=2))
    assert chunked.update(ids, 0) == "o"
    assert chunked.output_text == "Hello world f"
    # Without min_tokens the first 'o' stops it.
    plain = IncrementalDetokenizer(tok, [], SamplingParams(stop=["o"]))
    assert plain.update(ids[:1], 0) == "o" and plain.output_text == "Hell"


@pytest.mark.parametrize("skip, expected", [(True, "Hi there"), (False, "Hi there<|im_end|>")])
def test_skip_special_tokens(smollm2_hf_tokenizer, skip, expected):
    tok = smollm2_hf_tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = _ids(tok, "Hi there") + [im_end]
    prompt_ids = tok.encode(_prompt(tok), add_special_tokens=False)
    detok, _, deltas, _ = _stream(tok, prompt_ids, ids, SamplingParams(skip_special_tokens=skip))
    assert detok.output_text == expected == tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == expected


@pytest.mark.parametrize("include, expected", [(False, "Hi there"), (True, "Hi there<|im_end|>")])
def test_stop_terminated_token_text(smollm2_hf_tokenizer, include, expected):
    tok = smollm2_hf_tokenizer
    ids = _ids(tok, "Hi there") + [tok.convert_tokens_to_ids("<|im_end|>")]
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tok, [], params)
    detok.update(ids[:-1], 0)
    assert detok.update(ids[-1:], len(ids) - 1, stop_terminated=True) is None
    assert detok.output_text == expected
    assert detok.num_output_tokens == len(ids)


class _TokenStringsOnly:
    """The same tokenizer without its Rust backend: decoding goes through our token-string window."""

    def __init__(self, tok):
        self.tok = tok

    def __len__(self):
        return len(self.tok)

    def convert_ids_to_tokens(self, ids, skip_special_tokens=False):
        return self.tok.convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_string(self, tokens):
        return self.tok.convert_tokens_to_string(tokens)


@pytest.mark.parametrize("skip", [True, False])
def test_decode_stream_matches_token_string_window(smollm2_hf_tokenizer, skip):
    """DecodeStream (the fast tokenizer's path) emits the same pieces as our own window, on
    random ids with split characters, control tokens and out-of-vocabulary ids."""
    tok = smollm2_hf_tokenizer
    params = SamplingParams(skip_special_tokens=skip)
    assert isinstance(IncrementalDetokenizer(tok, [], params)._decoder, StreamDecoder)
    rng = random.Random(0)
    fragments = _ids(tok, "🙂東京 é👍🏽")
    chat = tok.encode(_prompt(tok), add_special_tokens=False)
    prompts = [[], chat, _ids(tok, "Hi 🙂")[:-1]]  # the last one ends inside a character
    for k in range(120):
        ids = [rng.choice(fragments) if r < 0.35 else rng.randrange(17) if r < 0.5
               else len(tok) + 3 if r < 0.52 else rng.randrange(len(tok))
               for r in (rng.random() for _ in range(rng.randrange(1, 30)))]
        fast = _stream(tok, prompts[k % 3], ids, params)
        slow = _stream(_TokenStringsOnly(tok), prompts[k % 3], ids, params)
        assert fast[0].output_text == slow[0].output_text and fast[2] == slow[2] and fast[3] == slow[3]


def test_detokenize_token(smollm2_hf_tokenizer):
    tok = smollm2_hf_tokenizer
    hi = _ids(tok, " hi")
    assert len(hi) == 1 and detokenize_token(tok, hi[0]) == " hi"
    assert detokenize_token(tok, tok.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"
    # A fragment of a character shows its bytes (vLLM's "bytes:" form), so fragments differ.
    smile = _ids(tok, "🙂")
    shown = [detokenize_token(tok, t) for t in smile]
    assert all(s.startswith("bytes:\\x") for s in shown) and len(set(shown)) == len(shown)
    assert b"".join(bytes(int(h, 16) for h in s[6:].split("\\x")[1:]) for s in shown) == "🙂".encode()
    assert detokenize_token(tok, len(tok) + 10) == ""
    assert detokenize_token(tok, -1) == ""


def test_find_stop_string_picks_first_to_end():
    assert find_stop_string("xabcd", 5, ["abcd", "bc"]) == ("bc", 2)
    assert find_stop_string("xabc", 4, ["bc", "abc"]) == ("abc", 1)
    assert find_stop_string("abcdef", 1, ["abc"]) is None  # already searched before
    assert find_stop_string("abcdef", 4, ["abc"]) == ("abc", 0)
    assert find_stop_string("abc", 0, ["abc"]) is None


class _SlowTokenizer:
    """A slow (pure-Python) tokenizer with two added tokens, in transformers' interface."""
    is_fast = False
    all_special_tokens = ["<s>"]
    all_special_ids = [0]
    _vocab = ["<s>", "<tool>", "<end>", "▁hello", "▁world", "x"]

    def get_added_vocab(self):
        return {"<s>": 0, "<tool>": 1, "<end>": 2}

    def __len__(self):
        return len(self._vocab)

    def convert_ids_to_tokens(self, ids, skip_special_tokens=False):
        return [self._vocab[i] for i in ids if not (skip_special_tokens and i in self.all_special_ids)]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens).replace("▁", " ")


@pytest.mark.parametrize("spaces, want", [(True, " hello <tool>  world <end> x"),  # vLLM's join
                                          (False, " hello<tool> world<end>x")])
def test_spaces_between_special_tokens_with_a_slow_tokenizer(spaces, want):
    from jaxkv.engine.incremental_decoders import WindowDecoder, tokens_to_string
    tok = _SlowTokenizer()
    ids = [3, 1, 4, 2, 5]
    assert tokens_to_string(tok, tok.convert_ids_to_tokens(ids), False, spaces) == want
    w = WindowDecoder(tok, [], 0, 0, skip_special_tokens=True, spaces_between_special_tokens=spaces)
    assert "".join(w.step(i) for i in ids) == want


def test_spaces_between_special_tokens_changes_nothing_with_a_fast_tokenizer(smollm2_hf_tokenizer):
    """As vLLM: the fast path joins nothing (SmolLM2's control tokens with skip off)."""
    from jaxkv import SamplingParams
    from jaxkv.engine.detokenizer import IncrementalDetokenizer
    tok = smollm2_hf_tokenizer
    ids = tok.encode("Hi<|im_end|><|im_start|>there", add_special_tokens=False)
    texts = []
    for spaces in (True, False):
        d = IncrementalDetokenizer(tok, [1, 2], SamplingParams(skip_special_tokens=False,
                                                               spaces_between_special_tokens=spaces))
        d.update(ids, 0)
        texts.append(d.output_text)
    assert texts[0] == texts[1] == tok.decode(ids)
