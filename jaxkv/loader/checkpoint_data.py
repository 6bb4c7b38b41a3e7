"""The one record every loader returns: config, tensors and tokenizer, in Hugging Face terms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# Keys every `Checkpoint.config` carries (values may be None where noted in `Checkpoint`).
CONFIG_KEYS = (
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "rope_theta",
    "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
    "eos_token_id", "rope_scaling", "attention_bias", "sliding_window",
)


@dataclass
class Checkpoint:
    """A loaded model, before conversion to JAX params.

    config: a Hugging Face config.json-style dict with at least `CONFIG_KEYS`:
        architectures (list[str], e.g. ["LlamaForCausalLM"]), model_type ("llama" | "qwen2" |
        "qwen3" | ...), sizes as ints, head_dim (int), rope_theta / rms_norm_eps (float),
        tie_word_embeddings (bool), bos_token_id / eos_token_id (int, list[int] or None),
        rope_scaling (dict with "rope_type", or None), attention_bias (bool),
        sliding_window (int or None).
    tensors: Hugging Face parameter name -> numpy array, e.g.
        "model.embed_tokens.weight"                      [vocab, hidden]
        "model.layers.{i}.self_attn.{q,k,v,o}_proj.weight" [out, in] (torch Linear layout)
        "model.layers.{i}.self_attn.{q,k,v}_proj.bias"   [out]      (attention_bias only)
        "model.layers.{i}.self_attn.{q,k}_norm.weight"   [head_dim] (Qwen3 only)
        "model.layers.{i}.mlp.{gate,up,down}_proj.weight" [out, in]
        "model.layers.{i}.{input,post_attention}_layernorm.weight", "model.norm.weight" [hidden]
        "lm_head.weight"                                 [vocab, hidden] (only when untied)
        GGUF loads are float32; HF folders keep their stored dtype (bfloat16 as ml_dtypes.bfloat16).
    tokenizer: a transformers PreTrainedTokenizerFast (chat_template set when the model has one),
        or None when a loader was asked not to build one.
    """

    config: dict[str, Any]
    tensors: dict[str, np.ndarray]
    tokenizer: Any

    def num_params(self) -> int:
        """Total number of elements over all tensors."""
        return int(sum(t.size for t in self.tensors.values()))
