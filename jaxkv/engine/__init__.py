"""Engine layer: LLMEngine (add_request / step / abort_request) and AsyncLLM (the engine on its
own thread, with async output streams).

Imported lazily so that host bookkeeping (jaxkv.core, jaxkv.engine.request) stays free of JAX.
"""

__all__ = ["AsyncLLM", "LLMEngine"]


def __getattr__(name):
    if name == "LLMEngine":
        from jaxkv.engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "AsyncLLM":
        from jaxkv.engine.async_llm import AsyncLLM
        return AsyncLLM
    raise AttributeError(name)
