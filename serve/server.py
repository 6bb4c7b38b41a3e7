"""`jaxkv serve`: start uvicorn at once (so /health can answer 503 during warmup), build and
warm the engine on a side thread, then serve. A bad flag or model path is a one-line error
before anything starts; an engine that fails to build stops the server with status 1. In a
multi-process engine (--num-processes) only process 0 serves; the others run its steps and
exit when it stops (jaxkv/runner/multiprocess.py)."""

from __future__ import annotations

import logging
import os
import threading
import time

logger = logging.getLogger("jaxkv")

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


def served_model_name(model: str | None, override: str | None) -> str:
    """--served-model-name, else the embedded model's name, else MODEL as given (vLLM)."""
    if override:
        return override
    return EMBEDDED_MODEL_NAME if model is None else model


def run_server(ns) -> int:
    """`jaxkv serve`: check the flags, join a multi-process job, start the HTTP server and, on
    a thread, the engine (/health answers 200 once it is ready). Returns the exit status: 1
    when the engine failed to start or died."""
    import uvicorn

    from jaxkv.loader.source import read_config
    from jaxkv.logger import setup_logging
    from jaxkv.models.model_config import ModelConfig
    from serve.app import build_app
    from serve.metrics import PrometheusStatLogger, cache_config_info, check_metrics_prefix

    args = _engine_args(ns)
    check_metrics_prefix(ns.metrics_prefix)
    hf_config = read_config(args.model)  # a missing or unreadable model fails here, in one line
    setup_logging()
    from prometheus_client import disable_created_metrics
    disable_created_metrics()  # as vLLM: no *_created series
    _join_job(args)
    ctx = _server_context(ns, args)
    max_model_len = args.max_model_len or ModelConfig.from_hf_config(hf_config).max_position_embeddings
    metrics = PrometheusStatLogger(lambda: ctx.engine.stats() if ctx.engine is not None else None,
                                   ctx.model_name, max_model_len, prefix=ns.metrics_prefix,
                                   cache_info=cache_config_info(args))
    config = uvicorn.Config(build_app(ctx, metrics), host=ns.host, port=ns.port, log_level="info",
                            timeout_graceful_shutdown=5, access_log=not ns.disable_uvicorn_access_log)
    server = uvicorn.Server(config)
    status = {"code": 0}
    threading.Thread(target=_start_engine, args=(ns, args, ctx, metrics, server, status),
                     name="jaxkv-startup", daemon=True).start()
    server.run()
    if ctx.engine is not None:
        ctx.engine.shutdown()
    return status["code"]


def _engine_args(ns):
    """EngineArgs from the flags; ValueError in one line for a bad flag."""
    from jaxkv.engine_args import EngineArgs

    if ns.model_tag is not None and ns.model is not None and ns.model_tag != ns.model:
        raise ValueError(f"two models given: {ns.model_tag!r} (positional) and --model {ns.model!r}")
    ns.model = ns.model_tag if ns.model_tag is not None else ns.model
    if ns.port is not None and not 0 <= ns.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {ns.port}")
    return EngineArgs.from_cli_args(ns)  # validates every engine flag


def _join_job(args) -> None:
    """A multi-process engine: join the job first; only process 0 serves HTTP (the others run
    its steps and exit when it stops)."""
    from jaxkv.runner import multiprocess
    if multiprocess.wanted(args):
        import jax
        multiprocess.initialize(args)
        if jax.process_index() > 0:
            from jaxkv.engine.llm_engine import LLMEngine
            LLMEngine.from_engine_args(args)


def _server_context(ns, args):
    """The routes' shared state; ValueError in one line for a bad chat template path, tool
    flags or tokenizer path."""
    from jaxkv.chat_utils import load_chat_template
    from serve.context import ServerContext
    from serve.response_store import ResponseStore, store_enabled
    from serve.tool_parsers import TOOL_CALL_PARSERS

    chat_template = load_chat_template(ns.chat_template)  # a bad path fails here, in one line
    if ns.enable_auto_tool_choice and not ns.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of: "
                         f"{', '.join(TOOL_CALL_PARSERS)})")
    if args.tokenizer is not None and not os.path.exists(args.tokenizer):
        raise ValueError(f"tokenizer {args.tokenizer!r} not found (a tokenizer folder or a .gguf file)")
    return ServerContext(model_name=served_model_name(args.model, ns.served_model_name),
                         chat_template=chat_template, enable_auto_tool_choice=ns.enable_auto_tool_choice,
                         tool_call_parser=ns.tool_call_parser,
                         enable_tokenizer_info_endpoint=ns.enable_tokenizer_info_endpoint,
                         reasoning_parser=ns.reasoning_parser,
                         response_store=(ResponseStore() if store_enabled(ns.enable_responses_api_store)
                                         else None),
                         model_path=args.model, api_key=ns.api_key or os.environ.get("JAXKV_API_KEY"),
                         created=int(time.time()))


def _start_engine(ns, args, ctx, metrics, server, status: dict) -> None:
    """The engine's start on its own thread; then, as vLLM, a dead engine stops the server
    with status 1, so a supervisor can restart it."""
    from jaxkv.engine.async_llm import AsyncLLM
    from jaxkv.engine.gc_heap import freeze_startup_heap
    try:
        ctx.engine = AsyncLLM.from_engine_args(args, log_stats=not ns.disable_log_stats,
                                               stat_loggers=[metrics])
        logger.debug("gc: %d start-up objects frozen", freeze_startup_heap())
        logger.info("serving %s at http://%s:%d/v1 (ready)", ctx.model_name, ns.host, ns.port)
    except Exception as e:  # noqa: BLE001 - reported, then the server stops
        ctx.start_error = f"{type(e).__name__}: {e}"
        logger.error("the engine failed to start: %s", ctx.start_error)
        status["code"] = 1
        server.should_exit = True
        return
    while not server.should_exit:
        if ctx.engine.dead is not None:
            logger.error("the engine stopped (%r); shutting the server down", ctx.engine.dead)
            status["code"] = 1
            server.should_exit = True
        time.sleep(0.5)


def add_serve_parser(sub) -> None:
    from jaxkv.engine_args import EngineArgs
    from serve.reasoning_parsers import REASONING_PARSERS
    from serve.tool_parsers import TOOL_CALL_PARSERS
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="a .gguf file or a Hugging Face model folder (default: the embedded model)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (also JAXKV_API_KEY)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: SmolLM2-135M-Instruct or MODEL)")
    s.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template inline) for "
                   "/v1/chat/completions instead of the tokenizer's own")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model choose to call tools (tool_choice "auto"; needs '
                   "--tool-call-parser)")
    s.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="how tool calls are read from the model's text for tool_choice auto "
                   "(hermes: <tool_call>{...}</tool_call>, Qwen2.5 and Hermes models)")
    s.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput log line")
    s.add_argument("--metrics-prefix", default="jaxkv",
                   help="prefix of the /metrics series names (default: jaxkv; vllm gives vLLM's "
                   "own names, for routers that read them)")
    s.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log line per request")
    s.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split a thinking model's <think>...</think> block from its answer "
                   "(reasoning_content in chat, a reasoning item in /v1/responses)")
    s.add_argument("--enable-responses-api-store", action="store_true",
                   help="keep finished /v1/responses responses (the newest 1000, 64 MiB in all) "
                   "for GET /v1/responses/{id} and previous_response_id (also "
                   "VLLM_ENABLE_RESPONSES_API_STORE=1; off by default, as in vLLM)")
    s.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (the tokenizer's configuration, chat template "
                   "included; off by default, as in vLLM, since a template may be private)")
    EngineArgs.add_cli_args(s)
    s.set_defaults(func=run_server)
