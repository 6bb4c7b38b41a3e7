"""The GGUF v2/v3 header: metadata and tensor infos, read without dequantizing anything.

gguf.GGUFReader spends ~3 s decoding SmolLM2's vocabulary; this reader skips string arrays it
is not asked for (~40 ms). Layout from the GGUF spec (ggml's docs/gguf.md): magic, version,
tensor count, metadata count, metadata key/value pairs, tensor infos, then the aligned data.
Both `gguf.py` (config, tensors) and `gguf_tokenizer.py` (vocabulary) read headers through it.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from typing import Any

import numpy as np

# GGUF metadata value types: 8 = string, 9 = array, the rest numbers.
_NUMBERS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
            10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class _Cursor:
    """Reads GGUF values from a buffer, advancing `pos`."""

    def __init__(self, buf, pos: int, strings: tuple[str, ...]):
        self.buf, self.pos, self.strings = buf, pos, strings

    def take(self, fmt: struct.Struct) -> Any:
        self.pos += fmt.size
        return fmt.unpack_from(self.buf, self.pos - fmt.size)[0]

    def string(self) -> str:
        n = self.take(_U64)
        self.pos += n
        return self.buf[self.pos - n:self.pos].decode("utf-8")

    def numbers(self, vtype: int, count: int) -> np.ndarray:
        out = np.frombuffer(self.buf, _NUMBERS[vtype], count, self.pos).copy()
        self.pos += out.nbytes
        return out

    def value(self, vtype: int, key: str) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            return self.numbers(vtype, 1)[0].item()
        etype, count = self.take(_U32), self.take(_U64)
        if etype == _STRING and key in self.strings:
            return [self.string() for _ in range(count)]
        if etype == _STRING:  # a vocabulary: skip it, keep its length
            for _ in range(count):
                n = self.take(_U64)  # first: `self.pos += self.take(...)` would read pos before it
                self.pos += n
            return count
        if etype == _ARRAY:
            return [self.value(_ARRAY, key) for _ in range(count)]
        return self.numbers(etype, count)


def read_gguf_metadata(path: str | os.PathLike, strings: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """Parse a GGUF v2/v3 header (~40 ms for SmolLM2; nothing is dequantized).

    Returns (metadata, tensor_infos). metadata: key -> int | float | bool | str | np.ndarray
    (numeric arrays) | list; string arrays become their length unless their key is in `strings`
    (then list[str]). A `rope_freqs.weight` tensor (F32/F16) is read into metadata["rope_freqs"]
    (float32). tensor_infos: name -> (dims in GGUF order, innermost first; ggml type id;
    absolute byte offset). Raises FileNotFoundError, or ValueError for a file that is not GGUF v2/v3.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version = struct.unpack_from("<4sI", buf, 0) if len(buf) >= 8 else (b"", 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path} is not a GGUF v2/v3 file (magic {magic!r}, version {version})")
        cur = _Cursor(buf, 8, strings)
        n_tensors, n_kv = cur.take(_U64), cur.take(_U64)
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.take(_U32), key)
        infos = {}
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.take(_U64) for _ in range(cur.take(_U32))]
            infos[name] = (dims, cur.take(_U32), cur.take(_U64))
        align = int(metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // align) * align
        infos = {name: (dims, kind, data_start + off) for name, (dims, kind, off) in infos.items()}
        if "rope_freqs.weight" in infos:
            metadata["rope_freqs"] = _rope_freqs(buf, path, *infos["rope_freqs.weight"])
    return metadata, infos


def _rope_freqs(buf, path: str, dims: list[int], kind: int, offset: int) -> np.ndarray:
    """llama.cpp's Llama-3 rope factors tensor (ggml type 0 = F32 or 1 = F16), as float32."""
    if kind not in (0, 1):
        raise ValueError(f"{path}: rope_freqs.weight has unsupported ggml type {kind}")
    freqs = np.frombuffer(buf, np.float32 if kind == 0 else np.float16, math.prod(dims), offset)
    return freqs.astype(np.float32)  # a copy: no view keeps the map open
