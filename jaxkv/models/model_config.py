"""ModelConfig: the architecture facts the model, the loader and the KV budget need.

Built from a Hugging Face config.json-style dict (GGUF metadata is mapped to the same keys).
"""

from __future__ import annotations

from dataclasses import dataclass

# HF architecture name -> (family flags). The Llama family covers all of these.
ARCHITECTURES = {
    "LlamaForCausalLM": dict(qk_norm=False),
    "MistralForCausalLM": dict(qk_norm=False),
    "Qwen2ForCausalLM": dict(qk_norm=False),
    "Qwen3ForCausalLM": dict(qk_norm=True),
    # Mixtures of experts (jaxkv/models/moe.py): the same attention, a sparse MLP.
    "MixtralForCausalLM": dict(qk_norm=False),
    "Qwen2MoeForCausalLM": dict(qk_norm=False),
    "Qwen3MoeForCausalLM": dict(qk_norm=True),
    # Gemma 2: (1 + w) RMSNorms before and after attention and MLP, GeGLU, soft-capping;
    # Gemma 3 (text): the same with q/k norms and a RoPE table of its own for local layers.
    "Gemma2ForCausalLM": dict(qk_norm=False),
    "Gemma3ForCausalLM": dict(qk_norm=True),
}
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")

MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "gemma2": "Gemma2ForCausalLM",
               "gemma3_text": "Gemma3ForCausalLM"}
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_scaling: tuple | None  # sorted items of the HF rope_scaling dict, hashable
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None
    # Mixture of experts (0 experts: a dense model): experts per MoE layer, how many each token
    # is routed to, each expert's intermediate size, whether the top-k weights are renormalized
    # to sum to 1, the shared expert's intermediate size (Qwen2-MoE; 0: none), and which layers
    # are MoE (the others keep a dense MLP of intermediate_size).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    # Each layer's sliding window (None: global attention); empty: every layer global.
    layer_windows: tuple = ()
    # Gemma's departures (Gemma2ForCausalLM): RMSNorm weights as (1 + w), the embedding
    # scaled by sqrt(hidden_size), norms before and after both attention and MLP ("sandwich"),
    # the MLP's activation (silu, or gelu_tanh: GeGLU), tanh soft-capping of the attention
    # scores and of the final logits, and the attention scale (query_pre_attn_scalar ** -0.5;
    # None: head_dim ** -0.5).
    gemma: bool = False
    # Gemma 3: the sliding-window layers' RoPE base (their own table, unscaled); None: one
    # table (rope_theta, rope_scaling) for every layer.
    rope_local_theta: float | None = None
    mlp_activation: str = "silu"
    attn_softcap: float | None = None
    final_softcap: float | None = None
    attn_scale: float | None = None

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window in tokens (a query sees itself and the window - 1
        keys before it), or None for global attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    def scan_refusal(self, quantized: bool, tensor_parallel: bool) -> str | None:
        """Why the decoder layers cannot run as one scan over stacked weights
        (LlamaModel.scan_layers), or None: every layer must be alike (one sliding window or
        none, no mixture of dense and MoE layers), float (quantized layers keep their own
        leaves) on one device (a tensor-parallel mesh shards each layer on its own)."""
        if len({self.window(i) for i in range(self.num_layers)}) > 1:
            return f"{self.architecture}'s layers differ in their sliding windows"
        if self.moe_layers:
            return f"{self.architecture}'s mixture-of-experts layers are not scanned"
        if quantized:
            return "quantized layers are not scanned"
        if tensor_parallel:
            return "a tensor-parallel or multi-process engine shards each layer on its own"
        return None

    @property
    def kv_sliding_window(self) -> int | None:
        """The window behind which no layer reads a sequence's K/V (the largest), when every
        layer is windowed; None when any layer is global (it keeps every block)."""
        if not self.layer_windows or any(w is None for w in self.layer_windows):
            return None
        return max(self.layer_windows)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelConfig":
        """Raises ValueError naming the architecture when it is not of the Llama family."""
        archs = cfg.get("architectures") or [MODEL_TYPES.get(cfg.get("model_type"), cfg.get("model_type"))]
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs!r}; jaxkv runs {sorted(ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        theta, rs, local_theta = _rope(arch, cfg)
        window = cfg.get("sliding_window") or None
        if arch in _QWEN and not cfg.get("use_sliding_window", False):
            window = None
        return cls(
            architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
            rope_theta=float(theta), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in _GEMMA)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")
                                or (arch == "Qwen2MoeForCausalLM" and cfg.get("qkv_bias", True))),
            qk_norm=ARCHITECTURES[arch]["qk_norm"],
            rope_scaling=rs,
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos, sliding_window=window,
            layer_windows=_layer_windows(cfg, window, arch), rope_local_theta=local_theta,
            **_moe_fields(arch, cfg),
            **_gemma_fields(arch, cfg))

    def num_params(self, active: bool = False) -> int:
        """Parameters of the checkpoint (Llama family: embeddings, attention with optional
        biases and q/k norms, gated MLP or experts, RMSNorms, LM head unless tied); with
        `active`, those one token runs through (its top-k experts of each MoE layer)."""
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.attention_bias else 0)
        layer = attn + (4 if self.gemma else 2) * h + (2 * hd if self.qk_norm else 0)
        experts = self.num_experts_per_tok if active else self.num_experts
        moe = (experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
               + (3 * h * self.shared_expert_intermediate_size + h
                  if self.shared_expert_intermediate_size else 0))
        mlps = sum(moe if i in self.moe_layers else 3 * h * self.intermediate_size
                   for i in range(self.num_layers))
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embed + self.num_layers * layer + mlps + h


def _moe_fields(arch: str, cfg: dict) -> dict:
    """ModelConfig's mixture-of-experts fields from an HF config (transformers' names:
    Mixtral's num_local_experts and intermediate_size per expert; Qwen's num_experts,
    moe_intermediate_size, decoder_sparse_step, mlp_only_layers, shared expert)."""
    if arch == "MixtralForCausalLM":
        n = cfg.get("num_local_experts") or cfg.get("num_experts") or 8
        return _checked_moe(dict(
            num_experts=n, num_experts_per_tok=cfg.get("num_experts_per_tok") or 2,
            moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
            moe_layers=tuple(range(cfg["num_hidden_layers"]))))
    if arch not in _MOE_DEFAULTS:
        return {}
    # A key the config leaves out takes transformers' default for the family (as transformers
    # reads the same file); transformers 5 writes num_local_experts, older configs num_experts.
    d = _MOE_DEFAULTS[arch]
    get = lambda k: cfg[k] if cfg.get(k) is not None else d[k]  # noqa: E731
    n = cfg.get("num_experts") or cfg.get("num_local_experts") or d["num_experts"]
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    layers = tuple(i for i in range(cfg["num_hidden_layers"])
                   if n > 0 and i not in dense and (i + 1) % step == 0)
    return _checked_moe(dict(
        num_experts=n, num_experts_per_tok=get("num_experts_per_tok"),
        moe_intermediate_size=get("moe_intermediate_size"),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=(get("shared_expert_intermediate_size")
                                         if arch == "Qwen2MoeForCausalLM" else 0),
        moe_layers=layers))


# transformers' Qwen2MoeConfig / Qwen3MoeConfig defaults
_MOE_DEFAULTS = {
    "Qwen2MoeForCausalLM": dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                                shared_expert_intermediate_size=5632),
    "Qwen3MoeForCausalLM": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                shared_expert_intermediate_size=0),
}


def _checked_moe(f: dict) -> dict:
    """ValueError naming the field when a token would be routed to more experts than exist."""
    if not 1 <= f["num_experts_per_tok"] <= f["num_experts"]:
        raise ValueError(f"num_experts_per_tok {f['num_experts_per_tok']} must be between 1 and "
                         f"the {f['num_experts']} experts")
    return f


def _layer_windows(cfg: dict, window: int | None, arch: str = "") -> tuple:
    """Per layer: the window of a "sliding_attention" layer of transformers' layer_types, or
    without layer_types the model's sliding_window for every layer (Gemma 2: every other one,
    from the first, as transformers fills them in); () without a window."""
    if window is None:
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer or null, got {window!r}")
    types = cfg.get("layer_types")
    n = cfg["num_hidden_layers"]
    if types is None:  # transformers' defaults per family
        top = cfg.get("max_window_layers", n)
        if arch in _GEMMA:  # 1 of 2 (Gemma 2) or of 6 (Gemma 3) layers global
            every = 2 if arch == "Gemma2ForCausalLM" else cfg.get("sliding_window_pattern", 6)
            windowed = [(i + 1) % every != 0 for i in range(n)]
        elif arch == "Qwen2MoeForCausalLM":  # every other layer below max_window_layers
            windowed = [(i + 1) % 2 == 1 and i < top for i in range(n)]
        elif arch in _QWEN:  # the layers from max_window_layers on
            windowed = [i >= top for i in range(n)]
        else:
            windowed = [True] * n
        return tuple(window if w else None for w in windowed)
    if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must name sliding_attention or full_attention for each of "
                         f"the {n} layers, got {types!r}"[:300])
    return tuple(window if t == "sliding_attention" else None for t in types)


GEGLU = ("gelu_pytorch_tanh", "gelu_tanh")


def _rope(arch: str, cfg: dict) -> tuple:
    """(rope_theta, rope_scaling as sorted items or None, the local layers' theta or None).
    transformers 5 nests Gemma 3's per layer type (rope_parameters: {"full_attention": {...},
    "sliding_attention": {...}}); older configs say rope_theta, rope_local_base_freq and
    rope_scaling. ValueError naming a scaling type jaxkv does not implement."""
    params = cfg.get("rope_parameters") or {}
    local = None
    if arch == "Gemma3ForCausalLM":
        nested = "full_attention" in params
        glob = dict(params.get("full_attention") or {}) if nested else dict(cfg.get("rope_scaling") or {})
        theta = glob.pop("rope_theta", None) or cfg.get("rope_theta") or 1_000_000.0
        local = ((params.get("sliding_attention") or {}).get("rope_theta") if nested else None) \
            or cfg.get("rope_local_base_freq") or 10_000.0
        rs = glob or None
    else:
        rs = cfg.get("rope_scaling") or params or None
        rs = None if rs is None else {k: v for k, v in rs.items() if k != "rope_theta"}
        theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    if rs is not None:
        kind = rs.get("rope_type", rs.get("type", "default"))
        if kind == "default":
            rs = None
        elif kind not in ROPE_TYPES:
            raise ValueError(f"rope_scaling type {kind!r} is not supported ({', '.join(ROPE_TYPES)} are)")
    return float(theta), (tuple(sorted(rs.items())) if rs else None), (float(local) if local else None)


def _gemma_fields(arch: str, cfg: dict) -> dict:
    """ModelConfig's Gemma fields (transformers' Gemma2Config / Gemma3TextConfig names).
    ValueError naming the field for an activation jaxkv does not run."""
    if arch not in _GEMMA:
        return {}
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GEGLU:
        raise ValueError(f"hidden_activation {act!r} is not supported (jaxkv runs {GEGLU})")
    scalar = cfg.get("query_pre_attn_scalar") or 256  # transformers' default
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(name) is not None and not cfg[name] > 0:
            raise ValueError(f"{name} must be positive or null, got {cfg[name]!r}")
    return dict(gemma=True, mlp_activation="gelu_tanh",
                attn_softcap=cfg.get("attn_logit_softcapping"),
                final_softcap=cfg.get("final_logit_softcapping"), attn_scale=float(scalar) ** -0.5)
