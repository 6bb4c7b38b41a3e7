"""The "jaxkv" logger's console output, as vLLM's: level, time, message (INFO and up)."""

from __future__ import annotations

import logging


def setup_logging() -> logging.Logger:
    """Give the "jaxkv" logger a stderr handler once (later calls change nothing). It does not
    propagate to the root logger (vLLM's "vllm" logger neither): absl, which orbax logs
    through, gives the root logger a handler of its own, and every line would print twice."""
    log = logging.getLogger("jaxkv")
    if not log.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%H:%M:%S"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log
