"""The "jaxkv" logger's console output, as vLLM's: level, time, message (INFO and up)."""

from __future__ import annotations

import logging


def setup_logging() -> logging.Logger:
    """Give the "jaxkv" logger a stderr handler once (later calls change nothing)."""
    log = logging.getLogger("jaxkv")
    if not log.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%H:%M:%S"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
    return log
