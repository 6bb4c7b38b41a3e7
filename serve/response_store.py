"""The Responses API's store: finished responses kept for GET /v1/responses/{id} and for a
later request's `previous_response_id`, as vLLM keeps them.

Off by default, as in vLLM (its VLLM_ENABLE_RESPONSES_API_STORE; jaxkv takes that variable,
and --enable-responses-api-store): a stored response holds the whole conversation in server
memory. Bounded in number and in bytes (the JSON of each response and its conversation): the
oldest go first, and one larger than the whole budget is not kept (a warning says so).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict

logger = logging.getLogger("jaxkv")

ENV = "VLLM_ENABLE_RESPONSES_API_STORE"
MAX_RESPONSES = 1000
MAX_BYTES = 64 << 20


def store_enabled(flag: bool) -> bool:
    """The flag, or vLLM's environment variable set to 1 / true."""
    return flag or os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes")


class ResponseStore:
    """id -> (response dict, conversation: the chat messages that led to it and its reply,
    the instructions left out, since a later request gives its own)."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._items: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(self, response: dict, conversation: list[dict]) -> bool:
        """Keep a finished response; False (and a warning) when it alone exceeds max_bytes."""
        size = len(json.dumps([response, conversation], ensure_ascii=False).encode())
        if size > self.max_bytes:
            logger.warning("response %s (%d bytes) not stored: above the store's %d bytes",
                           response["id"], size, self.max_bytes)
            return False
        with self._lock:
            self._items[response["id"]] = (response, conversation, size)
            self._bytes += size
            while len(self._items) > self.max_responses or self._bytes > self.max_bytes:
                _, (_, _, gone) = self._items.popitem(last=False)
                self._bytes -= gone
        return True

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        with self._lock:
            item = self._items.get(response_id)
        return None if item is None else (item[0], item[1])
