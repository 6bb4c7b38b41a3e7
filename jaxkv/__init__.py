"""jaxkv: an LLM serving engine in JAX (paged KV cache, continuous batching, prefix caching).

`import jaxkv` is cheap: JAX, the loaders and the tokenizer are imported when first used.
"""

from jaxkv.outputs import CompletionOutput, Logprob, RequestOutput
from jaxkv.sampling.params import RequestOutputKind, SamplingParams
from jaxkv.structured_outputs.params import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestOutputKind", "StructuredOutputsParams"]


def __getattr__(name):
    if name == "LLM":
        from jaxkv.llm import LLM
        return LLM
    if name == "EngineArgs":
        from jaxkv.engine_args import EngineArgs
        return EngineArgs
    raise AttributeError(name)
