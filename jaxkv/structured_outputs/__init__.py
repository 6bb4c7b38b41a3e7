"""Structured outputs at the edge: what a request's output must satisfy (params.py:
StructuredOutputsParams, vLLM's fields, turned into llguidance grammar text and checked) and
the engine's StructuredOutputsConfig. The matchers and bitmasks of the running sequences are
host bookkeeping (jaxkv/core/grammar.py); the server's request fields map onto the params in
serve/response_format.py.
"""
