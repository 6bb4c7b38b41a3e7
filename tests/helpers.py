"""The one comparison rule for exact-output tests.

Outputs must be identical, or first diverge at a step where the reference's top-2
log-probability margin is below `tol` (floating-point reduction order legitimately differs
between batch shapes; at a near-tie either token is correct)."""

from __future__ import annotations


def margins_from_logprobs(logprobs: list[dict]) -> list[float]:
    """Top-2 margins per step from vLLM-style logprob dicts (requests made with logprobs >= 2)."""
    out = []
    for d in logprobs:
        ranked = sorted((lp.rank, lp.logprob) for lp in d.values() if lp.rank is not None)
        out.append(ranked[0][1] - ranked[1][1] if len(ranked) > 1 else float("inf"))
    return out


def assert_same_or_near_tie(got: list[int], ref: list[int], ref_margins: list[float],
                            tol: float = 1e-3, what: str = "") -> int | None:
    """Returns the divergence step (None when identical); fails with the step and margin."""
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            m = ref_margins[i]
            assert m < tol, (f"{what}: outputs diverge at step {i} ({a} vs {b}) where the reference's "
                             f"top-2 margin is {m:.2e} >= {tol}")
            return i
    assert len(got) == len(ref), f"{what}: lengths differ ({len(got)} vs {len(ref)}) with equal prefixes"
    return None


def write_tiny_model(path, config: dict) -> str:
    """A model folder for load_format="dummy" at `path` (a pathlib.Path): `config` as its
    config.json, and the embedded model's tokenizer files. Returns the folder as a str."""
    import json

    from jaxkv.loader.gguf import embedded_model_path
    from jaxkv.loader.gguf_tokenizer import tokenizer_from_gguf

    (path / "config.json").write_text(json.dumps(config))
    tokenizer_from_gguf(embedded_model_path()).save_pretrained(path)
    return str(path)
