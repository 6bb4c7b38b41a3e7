"""Request schemas of the OpenAI API (and vLLM's extras), as pydantic models.

Field names, defaults and ranges follow OpenAI's API reference and vLLM's
``vllm.entrypoints.openai.protocol``. Unknown fields are ignored with a warning in the log (as
vLLM does), so clients that send newer OpenAI fields keep working; but a field of vLLM's or
OpenAI's API that would change the output and that jaxkv does not implement (UNSUPPORTED) is
answered with 400 naming it, never silently dropped. Response bodies are in
serve/protocol_responses.py.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from jaxkv.sampling.params import MAX_N, SamplingParams
from jaxkv.structured_outputs.params import StructuredOutputsParams

# The sampling fields take the JSON types SamplingParams takes in Python, no coercion ("5",
# true and 2.0 are not ints; "0.5" is not a number), so both doors accept the same values.
Number = Union[StrictInt, StrictFloat]


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")


# Fields jaxkv does not implement -> the values that mean "not used" (sent by some clients
# by default). Any other value is refused with 400 naming the field.
UNSUPPORTED: dict[str, tuple] = {
    **dict.fromkeys(("functions", "function_call", "truncate_prompt_tokens", "prompt_logprobs",
                     "cache_salt", "logits_processors",
                     "mm_processor_kwargs", "prediction", "audio", "web_search_options",
                     "chat_template", "kv_transfer_params", "vllm_xargs"), (None,)),
    "guided_decoding_backend": (None, "auto", "guidance"),  # llguidance is jaxkv's one backend
    "tools": (None, []),  # completions only: chat declares them
    "tool_choice": (None, "none"),
    "priority": (None, 0),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "return_tokens_as_token_ids": (None, False),
    "modalities": (None, ["text"]),
}


class JsonSchemaResponseFormat(_Base):
    """response_format.json_schema (OpenAI's): the schema is under the key "schema"."""
    name: str = "response"
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage in every chunk


class _Sampling(_Base):
    """Fields shared by completions and chat completions."""
    model: str | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: Number | None = Field(None, ge=0)
    top_p: Number | None = Field(None, gt=0, le=1)
    stop: Union[StrictStr, list[StrictStr], None] = None
    seed: StrictInt | None = None
    presence_penalty: Number = Field(0.0, ge=-2, le=2)
    frequency_penalty: Number = Field(0.0, ge=-2, le=2)
    user: str | None = None
    # vLLM's extra sampling parameters
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: StrictInt = Field(0, ge=0)
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None
    logit_bias: dict[str, Number] | None = None  # OpenAI's; token id (as a string) -> bias
    # Structured outputs (serve/response_format.py turns them into StructuredOutputsParams)
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None
    guided_json: Union[StrictStr, dict, None] = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams for this request (ValueError names a bad field). Unset fields take
        vLLM's defaults (temperature 1, top_p 1)."""
        return SamplingParams(structured_outputs=structured_outputs,
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, max_tokens=max_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            # As vLLM: biases clamped to OpenAI's [-100, 100].
            logit_bias=({k: min(100.0, max(-100.0, v)) for k, v in self.logit_bias.items()}
                        if self.logit_bias else None),
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words)


Prompt = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_Sampling):
    """POST /v1/completions."""
    prompt: Prompt
    add_special_tokens: bool = True
    max_tokens: StrictInt | None = Field(16, ge=0)  # 0 only with echo: the prompt alone (serve/completions.py)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0)
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Base):
    type: Literal["text"]
    text: StrictStr


class ChatCompletionMessageParam(_Base):
    """One message of a chat request (the reply's message is protocol_responses.ChatMessage).
    An assistant message may carry the tool_calls it made (content null), and a "tool"
    message the result of one (tool_call_id)."""
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Parts are checked by jaxkv.chat_utils, whose errors name the part (messages[0].content[1]).
    content: Union[StrictStr, list[dict], None] = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    def as_dict(self) -> dict:
        """The message as jaxkv.chat_utils takes it (content None stays None: it is refused
        there with the field named, unless tool_calls are given)."""
        d = {"role": self.role, "content": self.content, "name": self.name}
        if self.tool_calls:
            d["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


class FunctionDefinition(_Base):
    name: StrictStr = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None


class ChatCompletionToolsParam(_Base):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(_Base):
    name: StrictStr


class ChatCompletionNamedToolChoiceParam(_Base):
    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""
    messages: list[ChatCompletionMessageParam]
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    documents: list[dict] | None = None
    echo: bool = False
    tools: list[ChatCompletionToolsParam] | None = None
    # None: "auto" when tools are given, else "none" (as vLLM)
    tool_choice: Union[Literal["none", "auto", "required"], ChatCompletionNamedToolChoiceParam, None] = None
    parallel_tool_calls: bool | None = True


class TokenizeRequest(_Base):
    """POST /tokenize: either a prompt or chat messages (vLLM's schema)."""
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatCompletionMessageParam] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None


class DetokenizeRequest(_Base):
    """POST /detokenize."""
    model: str | None = None
    tokens: list[StrictInt]
