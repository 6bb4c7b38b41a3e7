"""Weight quantization (vLLM's --quantization): the format the decoder layers' linear weights
(q, k, v, o, gate, up, down) are kept in on the device, decided once from the flag and the
checkpoint's ``quantization_config``. The LM head and the embedding stay in the model's dtype (but for gguf).

- ``fp8``: float8 e4m3 weights, a float32 scale per output channel (a per-tensor scale is
  broadcast). A float checkpoint is quantized at load (max|W| / 448 per output channel, where
  vLLM's online fp8 takes one per tensor: see load.quantize_fp8); a checkpoint in vLLM's fp8 format (``quant_method: "fp8"``) or
  llm-compressor's (``compressed-tensors``, ``float-quantized``, per tensor or per channel)
  is read as it is. On a GPU the matmul is W8A8 (activations quantized per token, dynamically,
  the product accumulated in float32); elsewhere the weights are widened inside the matmul.
- ``awq`` / ``gptq``: 4-bit integers in groups along the input dimension (``group_size``,
  128 by default) with a float16 scale and an integer zero point per group and output channel,
  as AutoAWQ's GEMM layout and GPTQ's (act-order ``g_idx`` included) store them; unpacked at
  load into one layout (two values per byte), dequantized inside the matmul. llm-compressor's
  int4 (``compressed-tensors``, format ``pack-quantized``, method "pack-quantized" here:
  symmetric or with zero points, per group or per channel) is read into the same layout.
- ``gguf``: a GGUF file's Q8_0, Q4_0 and Q4_1 blocks (groups of 32 inputs, a float16 scale and
  min each: jaxkv/quantization/gguf.py) kept in that form for the layers and the embedding
  (which also serves as a tied LM head); the default for a GGUF file stays float weights
  (dequantized at load).

jaxkv/quantization/linear.py declares and applies the layers' leaves (JAX);
jaxkv/quantization/load.py turns checkpoint tensors into them (numpy).
"""

from __future__ import annotations

from dataclasses import dataclass

QUANTIZATIONS = ("fp8", "awq", "gptq", "compressed-tensors", "gguf")
FP8_MAX = 448.0  # the largest finite float8 e4m3fn value


@dataclass(frozen=True)
class QuantSpec:
    """How the decoder layers' linear weights are held.

    method: "fp8" | "awq" | "gptq" | "pack-quantized" (compressed-tensors int4) | "gguf"; bits: 8 (fp8) or 4; group_size: inputs per scale (None:
    one scale per output channel, fp8); act_order: GPTQ's g_idx reorders the inputs;
    fp8_activations: W8A8 (a GPU); online: quantized at load from float weights; checkpoint:
    the quant_method as the checkpoint names it (None when quantized at load); zero_offset:
    added to the stored zero points (1 for GPTQ's original format); embedding_bits: gguf's
    embedding kept in blocks of that many bits (None: in the model's dtype).
    """

    method: str
    bits: int = 8
    group_size: int | None = None
    act_order: bool = False
    fp8_activations: bool = False
    online: bool = False
    checkpoint: str | None = None
    zero_offset: int = 0  # GPTQ's original format stores each zero point minus one
    embedding_bits: int | None = None  # gguf: the embedding kept quantized in this many bits
    symmetric: bool = False  # pack-quantized: no zero points stored (each is 8 on the nibbles)
    # 4-bit layers on one GPU: steps of few rows multiply through pallas_kernels.int4_matmul
    # (the packed weights read once, dequantized in the kernel) instead of widening them first
    int4_kernel: bool = False

    @property
    def name(self) -> str:
        """The name stats, the log and /metrics show (vLLM's --quantization value)."""
        return self.checkpoint or self.method

    def layer_bytes(self, n_in: int, out: int) -> float:
        """Device bytes of one quantized [in, out] layer: its values, and per output channel
        fp8's float32 scale, or per group of inputs a float16 scale and a uint8 zero point
        (gguf: a float16 min); GPTQ act-order adds an int32 per input."""
        if self.method == "fp8":
            return n_in * out + 4 * out
        groups = n_in // self.group_size if self.group_size else 1
        per_group = 2 + (2 if self.method == "gguf" else 1)
        return n_in * out * self.bits / 8 + groups * out * per_group + (4 * n_in if self.act_order else 0)


def _linear_layers(mc) -> list[tuple[int, int, int]]:
    """(inputs, outputs, how many) of every quantized linear layer: q, k, v, o and the MLP's
    gate, up, down in each decoder layer; a mixture of experts' layers: each expert's and the
    shared expert's (the router and the shared expert's gate stay float)."""
    h, q, kv = mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    out = [(h, q, mc.num_layers), (h, kv, 2 * mc.num_layers), (q, h, mc.num_layers)]
    dense = mc.num_layers - len(mc.moe_layers)
    mlps = [(mc.intermediate_size, dense),
            (mc.moe_intermediate_size, mc.num_experts * len(mc.moe_layers)),
            (mc.shared_expert_intermediate_size, len(mc.moe_layers))]
    for m, n in mlps:
        if m and n:
            out += [(h, m, 2 * n), (m, h, n)]
    return out


def linear_params(mc) -> int:
    """Weights of the decoder layers' quantized linear modules (_linear_layers), all layers."""
    return sum(n_in * out * n for n_in, out, n in _linear_layers(mc))


def weights_bytes(mc, dtype_bytes: int, spec: QuantSpec | None) -> int:
    """Device bytes of the model's weights (ModelConfig `mc`, the float weights' bytes per
    value): the linear layers' at the quantized size, the rest in the model's dtype."""
    total = mc.num_params() * dtype_bytes
    if spec is None:
        return total
    out = total - linear_params(mc) * dtype_bytes
    out += sum(spec.layer_bytes(n_in, o) * n for n_in, o, n in _linear_layers(mc))
    if spec.embedding_bits:  # gguf: the embedding in its own blocks
        blocks = QuantSpec("gguf", bits=spec.embedding_bits, group_size=32)
        out += blocks.layer_bytes(mc.hidden_size, mc.vocab_size) - mc.vocab_size * mc.hidden_size * dtype_bytes
    return int(out)


def check_tensor_parallel(spec: QuantSpec | None, mc, n: int, expert_parallel: bool = False) -> None:
    """ValueError in one line when a tensor-parallel split of n devices would cut a group of
    int4 inputs (o_proj and down_proj split along their inputs; a mixture of experts' experts'
    and shared expert's down_proj too, each expert's unless expert_parallel places whole
    experts)."""
    if spec is None or spec.group_size is None or n == 1:
        return  # one group per channel (group_size -1): its scales are replicated
    dims = [("o_proj", mc.num_heads * mc.head_dim), ("down_proj", mc.intermediate_size)]
    if mc.num_experts:
        dims = dims[:1] + [("experts.down_proj", 0 if expert_parallel else mc.moe_intermediate_size),
                           ("shared_expert.down_proj", mc.shared_expert_intermediate_size or 0)]
    for name, dim in dims:
        groups = dim // spec.group_size
        if groups % n:
            raise ValueError(f"tensor_parallel_size {n} must divide the {groups} input groups of "
                             f"{name} (quantization_config.group_size {spec.group_size})")


def check_layer_shapes(spec: QuantSpec | None, mc) -> None:
    """ValueError in one line when a layer's shape does not fit the format: a group size
    that does not divide its inputs, 4-bit outputs not a multiple of 8 (eight per int32)."""
    if spec is None or spec.method == "fp8":
        return
    h, q, kv, m = mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, mc.intermediate_size
    layers = {"q_proj": (h, q), "k_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, m),
              "down_proj": (m, h)}
    for kind, size in (("experts", mc.moe_intermediate_size),
                       ("shared_expert", mc.shared_expert_intermediate_size)):
        if mc.num_experts and size:
            layers.update({f"{kind}.gate_proj": (h, size), f"{kind}.down_proj": (size, h)})
    for name, (n_in, out) in layers.items():
        if spec.group_size and n_in % spec.group_size:
            raise ValueError(f"quantization_config.group_size {spec.group_size} does not divide "
                             f"the {n_in} inputs of {name}")
        need_in = 8 if spec.method == "gptq" else 2  # GPTQ packs along the inputs too
        if spec.method in ("awq", "gptq") and (out % 8 or n_in % need_in):
            raise ValueError(f"{name} has {out} outputs and {n_in} inputs; {spec.method} packs "
                             f"eight 4-bit values per int32 (outputs a multiple of 8, inputs "
                             f"of {need_in})")
        if spec.method == "pack-quantized" and n_in % 8:
            raise ValueError(f"{name} has {n_in} inputs; pack-quantized int4 packs eight "
                             "inputs per int32 (a multiple of 8)")


def resolve(asked: str | None, hf_config: dict, platform: str) -> QuantSpec | None:
    """The QuantSpec of `asked` (EngineArgs.quantization) and the checkpoint's
    quantization_config; None for float weights. ValueError in one line when they disagree,
    when a format needs a checkpoint it does not have, or for a format jaxkv does not read."""
    qc = hf_config.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be an object, got {qc!r}"[:200])
    if asked is not None and asked not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {asked!r}")
    if not qc:
        if asked is None:
            return None
        if asked == "gguf":
            raise ValueError("quantization='gguf' needs a .gguf model file")
        if asked == "fp8":
            return QuantSpec("fp8", fp8_activations=platform == "gpu", online=True)
        raise ValueError(f"quantization={asked!r} needs a checkpoint quantized that way (its "
                         "config.json has no quantization_config); jaxkv quantizes float "
                         "weights at load to fp8 only")
    method = qc.get("quant_method")
    if method == "gguf":  # a GGUF file: float weights unless its blocks (or fp8) are asked for
        if asked == "fp8":
            return QuantSpec("fp8", fp8_activations=platform == "gpu", online=True)
        return None if asked is None else _gguf(asked, qc)
    if asked == "gguf":
        raise ValueError("quantization='gguf' needs a .gguf model file")
    if asked is not None and asked != method:
        raise ValueError(f"quantization={asked!r} does not match the checkpoint's "
                         f"quantization_config.quant_method {method!r}")
    if method == "fp8":
        return _fp8_checkpoint(qc, platform)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, platform)
    if method in ("awq", "gptq"):
        return _int4_checkpoint(method, qc)
    raise ValueError(f"quantization_config.quant_method {method!r} is not supported (jaxkv "
                     f"reads {QUANTIZATIONS})")


def _fp8_checkpoint(qc: dict, platform: str) -> QuantSpec:
    if qc.get("weight_block_size"):
        raise ValueError("quantization_config.weight_block_size: block-wise fp8 scales are not "
                         "supported (per-tensor and per-channel are)")
    return QuantSpec("fp8", fp8_activations=platform == "gpu", checkpoint="fp8")


def _compressed_tensors(qc: dict, platform: str) -> QuantSpec:
    """llm-compressor's checkpoints: float-quantized fp8 (weights 8-bit float, per tensor or
    per channel) or pack-quantized int4 (W4A16: 4-bit integers, per group or per channel,
    symmetric or with zero points); one scheme for every quantized layer."""
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"quantization_config.config_groups must be a non-empty object, got "
                         f"{groups!r}"[:200])
    schemes = {name: _ct_weights(name, g) for name, g in groups.items()}
    kinds = set(schemes.values())
    if len(kinds) != 1:
        raise ValueError(f"quantization_config.config_groups: jaxkv reads one weight scheme for "
                         f"every layer, got {sorted(map(str, kinds))}"[:300])
    kind = kinds.pop()
    fmt = qc.get("format")
    if kind[0] == "float":
        if fmt not in (None, "float-quantized", "naive-quantized"):
            raise ValueError(f"quantization_config.format {fmt!r} is not supported for fp8 "
                             "weights (float-quantized is)")
        return QuantSpec("fp8", fp8_activations=platform == "gpu", checkpoint="compressed-tensors")
    if fmt != "pack-quantized":
        raise ValueError(f"quantization_config.format {fmt!r} is not supported for int4 weights "
                         "(pack-quantized is)")
    return QuantSpec("pack-quantized", bits=4, group_size=kind[1], checkpoint="compressed-tensors",
                     symmetric=kind[2], act_order=kind[3])


def _ct_weights(name: str, group) -> tuple:
    """("float", None, True, False) for fp8 weights, ("int", group size or None per
    channel, symmetric, act-order) for int4; ValueError naming the config group otherwise."""
    where = f"quantization_config.config_groups.{name}"
    w = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(w, dict):
        raise ValueError(f"{where}.weights must be an object, got {w!r}"[:200])
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    if (kind, bits) == ("float", 8) and strategy in ("tensor", "channel"):
        return "float", None, True, False
    if (kind, bits) != ("int", 4) or strategy not in ("group", "channel"):
        raise ValueError(f"{where}.weights: jaxkv reads compressed-tensors fp8 weights (type "
                         "float, 8 bits, per tensor or channel) and int4 ones (type int, 4 bits, "
                         f"per group or channel), got {w!r}"[:300])
    # actorder group (True: its older spelling; "dynamic" its alias): weight_g_idx gives each
    # input's group (GPTQ's act-order; llm-compressor wrote it, compressed-tensors 0.20 no
    # longer does). "weight"/"static" change only the calibration, not the format.
    act_order = w.get("actorder") in ("group", "dynamic", True)
    act = group.get("input_activations")
    if act:
        raise ValueError(f"{where}.input_activations: jaxkv reads int4 weights with float "
                         f"activations (W4A16), got {act!r}"[:300])
    size = w.get("group_size") if strategy == "group" else None
    if strategy == "group" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"{where}.weights.group_size must be a positive integer, got {size!r}")
    return "int", size, bool(w.get("symmetric", True)), act_order


def _int4_checkpoint(method: str, qc: dict) -> QuantSpec:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"quantization_config.bits: jaxkv reads 4-bit {method.upper()}, got {bits!r}")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if isinstance(group, bool) or not isinstance(group, int) or group == 0 or group < -1:
        raise ValueError(f"quantization_config.group_size must be a positive integer or -1, got {group!r}")
    if method == "awq":
        if str(qc.get("version") or "gemm").lower() != "gemm":
            raise ValueError(f"quantization_config.version {qc.get('version')!r}: jaxkv reads "
                             "AWQ's GEMM layout")
        if qc.get("zero_point") is False:
            raise ValueError("quantization_config.zero_point: AWQ without zero points is not supported")
    elif qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format {qc.get('checkpoint_format')!r}"
                         " is not supported (gptq and gptq_v2 are)")
    v1 = method == "gptq" and qc.get("checkpoint_format", "gptq") == "gptq"
    return QuantSpec(method, bits=4, group_size=None if group == -1 else group,
                     act_order=bool(qc.get("desc_act", False)), checkpoint=method,
                     zero_offset=1 if v1 else 0)


def _gguf(asked: str, qc: dict) -> QuantSpec:
    """The layers' blocks: 4-bit storage when every linear tensor is Q4_0 / Q4_1, 8-bit when
    some are Q8_0; the embedding kept when its type is one of those."""
    from jaxkv.quantization.gguf import KINDS
    if asked != "gguf":
        raise ValueError(f"quantization={asked!r} does not match a GGUF file (gguf keeps its "
                         "blocks, fp8 quantizes its weights at load; none: float weights)")
    types = qc["tensor_types"]
    layers = {n: k for n, k in types.items() if n.startswith("blk.")}
    bad = next((n for n, k in layers.items() if k not in KINDS), None)
    if bad is not None:
        raise ValueError(f"tensor {bad} is {layers[bad]}; --quantization gguf keeps "
                         f"{', '.join(KINDS)} blocks (leave it unset for float weights)")
    bits = 4 if all(k != "Q8_0" for k in layers.values()) else 8
    embed = types.get("token_embd.weight")
    return QuantSpec("gguf", bits=bits, group_size=32, checkpoint="gguf",
                     embedding_bits=(8 if embed == "Q8_0" else 4) if embed in KINDS else None)
