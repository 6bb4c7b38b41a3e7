"""ServerContext: what the routes share (the AsyncLLM once warm, the served model name)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxkv.sampling.params import RequestOutputKind
from serve.errors import APIError

# The routes always ask for DELTA outputs (non-streaming ones join them), so every step
# reaches the metrics and inter-token latency is observed per token.
OUTPUT_KIND = RequestOutputKind.DELTA


@dataclass
class ServerContext:
    model_name: str
    model_path: str | None = None
    engine: object | None = None      # AsyncLLM, set when warmup is done
    api_key: str | None = None
    start_error: str | None = None     # why the engine could not start
    created: int = 0
    chat_template: str | None = None   # --chat-template (None: the tokenizer's own)
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    tool_call_parser: str | None = None    # --tool-call-parser (serve/tool_parsers.py)
    enable_tokenizer_info_endpoint: bool = False  # --enable-tokenizer-info-endpoint
    response_store: object | None = None  # serve.response_store.ResponseStore when it is on
    reasoning_parser: str | None = None  # --reasoning-parser (serve/reasoning_parsers.py)

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.dead is None

    def not_ready_reason(self) -> str:
        if self.start_error:
            return f"the engine failed to start: {self.start_error}"
        if self.engine is None:
            return "the engine is starting (warmup)"
        return f"the engine stopped: {self.engine.dead!r}"

    def check_model(self, name: str | None) -> None:
        """404 for a model name this server does not serve (None means the served one)."""
        if name is not None and name != self.model_name:
            raise APIError(f"The model `{name}` does not exist.", 404, "model")
