"""Engine layer: LLMEngine (add_request / step / abort_request) and AsyncLLM (the engine on its
own thread, with async output streams). Neither imports JAX at import time: the runner is built
(and JAX imported) by LLMEngine.from_engine_args."""

from jaxkv.engine.async_llm import AsyncLLM
from jaxkv.engine.llm_engine import LLMEngine

__all__ = ["AsyncLLM", "LLMEngine"]
