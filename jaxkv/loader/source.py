"""Which loader a `model` argument means: None -> the embedded GGUF, *.gguf, a folder written
by `jaxkv convert` (jaxkv/loader/converted.py), or an HF folder."""

from __future__ import annotations

import os

PARAMS = "params"  # the orbax checkpoint's folder inside a converted folder


def is_converted(path: str | None) -> bool:
    """Whether `path` is a folder written by `jaxkv convert` (jaxkv/loader/converted.py): a
    config.json beside a params/ checkpoint."""
    return (path is not None and os.path.isdir(os.path.join(path, PARAMS))
            and os.path.isfile(os.path.join(path, "config.json")))


def load_checkpoint(model: str | None, load_format: str = "auto", keep_quantized: bool = False,
                    with_tokenizer: bool = True):
    """Returns a Checkpoint (tensors empty for load_format="dummy", and for a converted folder,
    whose params the engine restores with converted.restore_params). keep_quantized: a GGUF
    file's Q8_0 / Q4_0 / Q4_1 weights stay in blocks (--quantization gguf; see load_gguf).
    with_tokenizer=False: a GGUF file's tokenizer is not built (another one was given).

    Raises FileNotFoundError for a path that does not exist and ValueError for a format that
    does not match the path.
    """
    from jaxkv.loader.checkpoint_data import Checkpoint

    if model is None:
        from jaxkv.loader.gguf import embedded_model_path
        model = embedded_model_path()
    if not os.path.exists(model):
        raise FileNotFoundError(f"model {model!r} not found (give a .gguf file or a Hugging Face "
                                "model folder; jaxkv cannot download from a model hub)")
    is_gguf = os.path.isfile(model) and model.endswith(".gguf")
    if load_format == "gguf" and not is_gguf:
        raise ValueError(f"load_format='gguf' needs a .gguf file, got {model!r}")
    if load_format == "safetensors" and is_gguf:
        raise ValueError(f"load_format='safetensors' needs a model folder, got {model!r}")
    dummy = load_format == "dummy"
    if is_gguf:
        from jaxkv.loader.gguf import load_gguf, read_gguf_config
        if dummy:
            from jaxkv.loader.gguf_tokenizer import tokenizer_from_gguf
            return Checkpoint(read_gguf_config(model), {},
                              tokenizer_from_gguf(model) if with_tokenizer else None)
        return load_gguf(model, keep_quantized=keep_quantized, with_tokenizer=with_tokenizer)
    if is_converted(model) and load_format in ("auto", "dummy"):
        from transformers import AutoTokenizer
        return Checkpoint(read_config(model), {}, AutoTokenizer.from_pretrained(model))
    from jaxkv.loader.hf import load_hf_dir
    ckpt = load_hf_dir(model, load_weights=not dummy)
    _merge_generation_config_eos(model, ckpt.config)
    return ckpt


def load_tokenizer(path: str):
    """A tokenizer from a .gguf file or a Hugging Face folder with tokenizer files (vLLM's
    --tokenizer). FileNotFoundError when the path or the files are missing."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer {path!r} not found (give a .gguf file or a folder "
                                "with tokenizer files)")
    if os.path.isfile(path) and path.endswith(".gguf"):
        from jaxkv.loader.gguf_tokenizer import tokenizer_from_gguf
        return tokenizer_from_gguf(path)
    from jaxkv.loader.hf import _TOKENIZER_FILES
    if not os.path.isdir(path) or not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise FileNotFoundError(f"tokenizer {path!r}: no tokenizer files there (looked for "
                                f"{', '.join(_TOKENIZER_FILES)})")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def _merge_generation_config_eos(folder: str, config: dict) -> None:
    """vLLM stops on every EOS id of the model, including those only generation_config.json
    lists (Llama 3 Instruct's <|eot_id|>, Qwen2.5's <|im_end|>)."""
    import json
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        extra = json.load(f).get("eos_token_id")
    ids = []
    for v in (config.get("eos_token_id"), extra):
        for t in (v if isinstance(v, list) else [v]):
            if t is not None and t not in ids:
                ids.append(t)
    config["eos_token_id"] = ids


def read_config(model: str | None) -> dict:
    """The HF-style config of `model` without loading weights or a tokenizer (for `jaxkv plan`)."""
    if model is None:
        from jaxkv.loader.gguf import embedded_model_path
        model = embedded_model_path()
    if not os.path.exists(model):
        raise FileNotFoundError(f"model {model!r}: no such file or folder")
    if os.path.isfile(model) and model.endswith(".gguf"):
        from jaxkv.loader.gguf import read_gguf_config
        return read_gguf_config(model)
    import json
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {model!r}")
    with open(path) as f:
        return json.load(f)
