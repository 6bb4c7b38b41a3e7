"""Response bodies of the OpenAI API (and vLLM's extras), as pydantic models.

Field names follow OpenAI's API reference and vLLM's ``vllm.entrypoints.openai.protocol``;
only the fields jaxkv sends are declared. `model_dump()` gives the dict that is sent: every
field is present (None as null) except those a model names in `_omit_none`, which are left out
while None (a stream chunk's usage until the last chunk, a delta's role and content, ...).
"""

from __future__ import annotations

from typing import ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, model_serializer

StopReason = Union[int, str, None]  # the stop token id or stop string that ended a choice


class OpenAIResponse(BaseModel):
    """Base of the response models: None fields are sent as null unless named in _omit_none."""
    _omit_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _drop_omitted(self, handler):
        data = handler(self)
        for name in self._omit_none:
            if name in data and data[name] is None:
                del data[name]
        return data


class ErrorInfo(OpenAIResponse):
    message: str
    type: str            # vLLM's type name: BadRequestError, NotFoundError, ...
    param: str | None = None  # the request field at fault, when known
    code: int            # the HTTP status


class ErrorResponse(OpenAIResponse):
    """Every 4xx/5xx body, and the error event of a stream that fails after its headers."""
    error: ErrorInfo


class PromptTokenUsageInfo(OpenAIResponse):
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache


class UsageInfo(OpenAIResponse):
    """Token counts of one HTTP request, over all its prompts and samples."""
    _omit_none = ("prompt_tokens_details",)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


# --- /v1/completions


class CompletionLogProbs(OpenAIResponse):
    """Legacy-completions logprobs, one entry per token in each list. top_logprobs maps token
    text to logprob (the chosen token first); the first echoed prompt token has nulls."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []  # character offset of each token in the choice's text


class CompletionResponseChoice(OpenAIResponse):
    """One choice (index = prompt index * n + sample index); in a stream chunk, text and
    logprobs hold only what is new."""
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None


class CompletionResponse(OpenAIResponse):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIResponse):
    """One SSE chunk; usage only on the last one (stream_options.include_usage), whose
    choices are empty."""
    _omit_none = ("usage",)
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# --- /v1/chat/completions


class ChatCompletionLogProb(OpenAIResponse):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None  # the token's UTF-8 bytes


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    """The chosen token and the top_logprobs most likely ones (best first)."""
    top_logprobs: list[ChatCompletionLogProb] = []


class ChatCompletionLogProbs(OpenAIResponse):
    content: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(OpenAIResponse):
    name: str
    arguments: str  # the arguments as a JSON text


class ToolCall(OpenAIResponse):
    """One call of a tool the request offered (vLLM's id form: chatcmpl-tool-<hex>)."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIResponse):
    _omit_none = ("name", "arguments")
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIResponse):
    """A stream's piece of tool call `index`: the first carries id, type and name."""
    _omit_none = ("id", "type")
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatMessage(OpenAIResponse):
    """The generated message (with echo, the last request message's content first), and the
    tool calls parsed from it (empty unless the request offered tools)."""
    _omit_none = ("reasoning_content",)
    role: str
    content: str | None = None
    # --reasoning-parser: the <think> block apart from the answer (serve/reasoning_parsers.py)
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = []


class ChatCompletionResponseChoice(OpenAIResponse):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None


class ChatCompletionResponse(OpenAIResponse):
    id: str
    created: int
    model: str
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIResponse):
    """What a stream chunk adds to a message; unset fields are left out ({} carries none)."""
    _omit_none = ("role", "content", "reasoning_content", "tool_calls")
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(OpenAIResponse):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None


class ChatCompletionStreamResponse(OpenAIResponse):
    """One SSE chunk; usage only on the last one (stream_options.include_usage), whose
    choices are empty."""
    _omit_none = ("usage",)
    id: str
    created: int
    model: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# --- /v1/models, /tokenize, /detokenize


class ModelCard(OpenAIResponse):
    """The served model; max_model_len is left out until the engine is up."""
    _omit_none = ("max_model_len",)
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxkv"
    root: str | None = None    # the checkpoint it was loaded from
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIResponse):
    object: Literal["list"] = "list"
    data: list[ModelCard] = []


class KVCacheSnapshot(OpenAIResponse):
    """GET /kv_cache/blocks (jaxkv.engine.kv_snapshot): states per block (0 null, 1 free,
    2 cached, 3 in use, 4 shared), ref counts, counts per state, the block tables of the
    requests holding blocks, and the engine's stats."""
    block_size: int
    num_blocks: int
    states: list[int]
    ref_cnts: list[int]
    counts: dict[str, int]
    requests: list[dict]
    stats: dict


class VersionResponse(OpenAIResponse):
    version: str


class TokenizeResponse(OpenAIResponse):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(OpenAIResponse):
    prompt: str  # the decoded text


class TokenizerInfoResponse(OpenAIResponse):
    """GET /tokenizer_info (vLLM's, behind --enable-tokenizer-info-endpoint): the tokenizer's
    configuration as its tokenizer_config.json would hold it (bos/eos/pad/unk tokens,
    model_max_length, chat_template, ...; other keys as the tokenizer has them)."""
    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
