"""Engine layer: LLMEngine (add_request / step / abort_request)."""

from jaxkv.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine"]
