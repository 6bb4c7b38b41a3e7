"""Build a transformers fast tokenizer from GGUF metadata with the `tokenizers` library (no torch).

transformers' own GGUF tokenizer path imports torch; this one gives the same ids. It follows
transformers' GGUF converter: byte-level BPE from `tokenizer.ggml.tokens` / `.merges`, the
ByteLevel pre-tokenizer (or a llama.cpp split regex for the pre-tokenizer types transformers maps)
and decoder, control tokens (token_type 3) added as special tokens, user-defined ones (type 4) as
plain added tokens.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from jaxkv.loader.gguf_header import read_gguf_metadata  # fast: GGUFReader takes ~3 s

_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex (the subset of transformers' table a llama/qwen file can carry).
# Any other value (e.g. SmolLM2's "smollm") keeps GPT-2's ByteLevel regex, as transformers does.
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character map (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


_STRING_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


def _metadata(reader_or_path) -> dict:
    """GGUF metadata with the vocabulary and merges decoded, from a path or a gguf.GGUFReader."""
    from gguf import GGUFReader

    if isinstance(reader_or_path, GGUFReader):
        return {key: field.contents() for key, field in reader_or_path.fields.items()
                if key.startswith("tokenizer.")}
    return read_gguf_metadata(reader_or_path, strings=_STRING_KEYS)[0]


def _bpe_backend(tokens: list[str], spelled: list[str], merges: list, token_types: list[int],
                 pre: str | None, alphabet: set[str]) -> Tokenizer:
    """The byte-level BPE `tokenizers.Tokenizer` of a GGUF vocabulary: its pre-tokenizer split
    (`tokenizer.ggml.pre`), control tokens as special tokens and user-defined ones added."""
    vocab = {t: i for i, t in enumerate(spelled)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False))
    split = _PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel: skip it, as transformers does.
    backend.add_special_tokens([
        AddedToken(t, normalized=False, special=True)
        for t, kind_ in zip(tokens, token_types) if kind_ == _CONTROL and set(t) <= alphabet
    ])
    backend.add_tokens([
        AddedToken(t, normalized=False, special=False)
        for t, kind_ in zip(tokens, token_types) if kind_ == _USER_DEFINED and t in vocab
    ])
    return backend


def tokenizer_from_gguf(reader_or_path):
    """A `transformers.PreTrainedTokenizerFast` built from a GGUF file's tokenizer metadata.

    reader_or_path: a path (str / PathLike) or an open `gguf.GGUFReader`.
    bos/eos/unk/pad tokens come from `tokenizer.ggml.*_token_id`, `add_bos_token` /
    `add_eos_token` from the metadata flags (default False), `chat_template` from
    `tokenizer.chat_template`. Raises FileNotFoundError for a missing file and ValueError when
    `tokenizer.ggml.model` is not "gpt2" (byte-level BPE) or the vocabulary is missing.
    """
    from transformers import PreTrainedTokenizerFast

    meta = _metadata(reader_or_path)
    field = meta.get

    kind = field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer.ggml.model {kind!r} is not supported; only 'gpt2' (byte-level BPE) "
            f"is: pass tokenizer= (--tokenizer) a folder or hub id with the model's tokenizer"
        )
    tokens = field("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("GGUF file has no tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
    token_types = [int(t) for t in field("tokenizer.ggml.token_type", [1] * len(tokens))]

    # Tokens the file spells outside the byte alphabet are respelled byte by byte, as transformers does.
    spelling = byte_level_alphabet()
    alphabet = set(spelling.values())
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    backend = _bpe_backend(tokens, spelled, merges, token_types, field("tokenizer.ggml.pre"), alphabet)

    def token(key):
        index = field(f"tokenizer.ggml.{key}")
        return spelled[index] if index is not None and 0 <= index < len(tokens) else None

    kwargs = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(field("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(field("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    chat_template = field("tokenizer.chat_template")
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
