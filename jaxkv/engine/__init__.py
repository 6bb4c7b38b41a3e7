"""Engine layer: LLMEngine (add_request / step / abort_request).

Imported lazily so that host bookkeeping (jaxkv.core, jaxkv.engine.request) stays free of JAX.
"""

__all__ = ["LLMEngine"]


def __getattr__(name):
    if name == "LLMEngine":
        from jaxkv.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
