"""Hugging Face model folder (config.json + *.safetensors + tokenizer files) -> `Checkpoint`."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import numpy as np

from jaxkv.loader.checkpoint_data import Checkpoint

# HF architecture -> attention_bias when config.json does not say (Qwen2 always has q/k/v biases).
_DEFAULT_ATTENTION_BIAS = {"Qwen2ForCausalLM": True}
_TIED_BY_DEFAULT = {"Gemma2ForCausalLM", "Gemma3ForCausalLM"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """config.json of a model folder, with every `CONFIG_KEYS` entry present.

    Keys config.json already has are kept as they are; missing ones are derived the way
    transformers does (head_dim = hidden_size / heads, rope_theta and rope_scaling from the
    transformers-5 `rope_parameters`, num_key_value_heads = heads, ...).
    Raises FileNotFoundError when the folder or its config.json is missing.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model folder not found: {path}")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path} has no config.json; is it a Hugging Face model folder?")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)

    heads = config.get("num_attention_heads")
    rope = dict(config.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    defaults = {
        "architectures": [],
        "model_type": None,
        "num_key_value_heads": heads,
        "head_dim": config["hidden_size"] // heads if heads and "hidden_size" in config else None,
        "rope_theta": rope.get("rope_theta", 10000.0),
        "rope_scaling": None if rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"},
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        # transformers' own default (configs written before 4.44 leave out values equal to it)
        "tie_word_embeddings": _TIED_BY_DEFAULT.intersection(config.get("architectures") or ()) != set(),
        "bos_token_id": None,
        "eos_token_id": None,
        "sliding_window": None,
    }
    for key, value in defaults.items():
        if config.get(key) is None:
            config[key] = value
    archs = config["architectures"]
    config.setdefault("attention_bias", any(_DEFAULT_ATTENTION_BIAS.get(a, False) for a in archs))
    return config


def _safetensors_files(path: str) -> list[str]:
    """The folder's *.safetensors files (the index, when present, names them)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{index} names missing shard(s): {missing}")
        return files
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def load_hf_tensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of the folder's *.safetensors, as numpy arrays in their stored dtype.

    BF16 tensors come back as `ml_dtypes.bfloat16` arrays (cast with `.astype(np.float32)`);
    shapes are as stored ([out, in] for Linear weights). Raises FileNotFoundError when the
    folder has no .safetensors file (e.g. only pytorch_model.bin) and ValueError on a name
    that appears in two files.
    """
    import ml_dtypes  # noqa: F401  registers "bfloat16" with numpy, which safetensors' numpy loader needs
    from safetensors import safe_open

    path = os.fspath(path)
    files = _safetensors_files(path)
    if not files:
        others = [n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth", ".gguf"))]
        hint = f" (found {others}; convert to safetensors)" if others else ""
        raise FileNotFoundError(f"{path} has no *.safetensors weight files{hint}")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        header = _header(file)
        with safe_open(file, framework="numpy") as f:
            for name in f.keys():
                if name in tensors:
                    raise ValueError(f"tensor {name!r} appears in more than one file of {path}")
                kind = header[name]["dtype"]
                tensors[name] = (_read_float8(file, header, name) if kind in _FLOAT8
                                 else f.get_tensor(name))
    return tensors


# safetensors dtypes its numpy loader cannot make (numpy has no float8): read from the bytes.
_FLOAT8 = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _header(file: str) -> dict:
    """The safetensors header: tensor name -> {"dtype", "shape", "data_offsets"}; the data
    starts after the 8-byte length and the header."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header["__data_start__"] = 8 + n
    return header


def _read_float8(file: str, header: dict, name: str) -> np.ndarray:
    import ml_dtypes
    info = header[name]
    start, end = info["data_offsets"]
    with open(file, "rb") as f:
        f.seek(header["__data_start__"] + start)
        raw = f.read(end - start)
    return np.frombuffer(raw, getattr(ml_dtypes, _FLOAT8[info["dtype"]])).reshape(info["shape"]).copy()


def load_hf_dir(path: str | os.PathLike, *, load_weights: bool = True) -> Checkpoint:
    """Load a Hugging Face model folder: config (see `read_hf_config`), tensors, tokenizer.

    load_weights=False skips the safetensors (tensors == {}), for planning and dummy loads.
    `lm_head.weight` is dropped when `tie_word_embeddings` is true and it equals the embedding
    (some exports store the tied copy). The tokenizer is `AutoTokenizer.from_pretrained(path)`
    (a PreTrainedTokenizerFast with the folder's chat template); note that importing
    AutoTokenizer imports torch when torch is installed.
    Raises FileNotFoundError for a missing folder, config.json, weights or tokenizer files.
    """
    from transformers import AutoTokenizer

    path = os.fspath(path)
    config = read_hf_config(path)
    tensors = load_hf_tensors(path) if load_weights else {}
    if config["tie_word_embeddings"] and "lm_head.weight" in tensors:
        embed = tensors.get("model.embed_tokens.weight")
        if embed is not None and np.array_equal(embed, tensors["lm_head.weight"]):
            del tensors["lm_head.weight"]
    if not any(os.path.isfile(os.path.join(path, n)) for n in _TOKENIZER_FILES):
        raise FileNotFoundError(f"{path} has no tokenizer files (looked for {', '.join(_TOKENIZER_FILES)})")
    tokenizer = AutoTokenizer.from_pretrained(path)
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer)
