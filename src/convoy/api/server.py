"""The FastAPI app: settings, lifespan (the engine lives on app.state), thin routes.

client --> RequestLog --> APIKey --> BodyLimit --> routes --> CompletionServing / ChatServing
                                                                    |
                                                          EngineClient --> AsyncEngine
"""

from __future__ import annotations

import asyncio
import gc
import importlib.metadata
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from convoy.api.chat_template import check_continuation, check_template_kwargs
from convoy.api.engine_client import EngineClient, ServingLimits
from convoy.api.errors import APIError, install_error_handlers
from convoy.api.metrics import ServerMetrics
from convoy.api.middleware import APIKeyMiddleware, BodyLimitMiddleware, RequestLogMiddleware
from convoy.api.protocol_batch import UPLOAD_ROUTES
from convoy.api.protocol_chat import ChatCompletionRequest, ChatCompletionResponse
from convoy.api.protocol_completions import CompletionRequest, CompletionResponse
from convoy.api.protocol_embeddings import EmbeddingRequest, EmbeddingResponse
from convoy.api.protocol_info import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from convoy.api.protocol_responses import ResponsesRequest
from convoy.api.responses_store import ResponseStore
from convoy.api.routes.batches import add_batch_routes
from convoy.api.routes.common import (
    SCHEMA_REF,
    STREAMS,
    docs,
    parse_body,
    record,
    until_disconnect,
)
from convoy.api.routes.files import add_file_routes
from convoy.api.routes.page import add_page_routes, page_url
from convoy.api.routes.responses import add_response_routes
from convoy.api.serving_base import off_loop
from convoy.api.serving_chat import ChatServing, chat_text
from convoy.api.serving_completion import CompletionServing
from convoy.api.serving_embedding import EmbeddingServing
from convoy.api.serving_responses import ResponsesServing
from convoy.batch.db import BatchDB, DataDirBusy, default_data_dir
from convoy.batch.executor import LineRunner
from convoy.batch.service import BatchMetrics, lines_in_flight, local_routes, start_batches
from convoy.config import ServerConfig

if TYPE_CHECKING:
    from convoy.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-convoy-replica"  # names the Serve replica that answered (with --replicas)

try:
    VERSION = importlib.metadata.version("convoy")
except importlib.metadata.PackageNotFoundError:  # running from a source tree, not installed
    VERSION = "0.0.0+unknown"

BodyT = TypeVar("BodyT", bound=BaseModel)
# Request bodies the routes parse themselves (off the event loop), described in /openapi.json.
BODY_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest, ChatCompletionRequest, ResponsesRequest, EmbeddingRequest, TokenizeRequest,
    DetokenizeRequest,
)  # fmt: skip


# Everything `convoy serve` configures: `.engine` (an EngineConfig) plus the server's own fields.
# Defined (defaults, CLI help) in config.py; the CLI builds it, tests and benchmarks may too.


def _lifespan(
    settings: ServerConfig, engine: AsyncEngine | None, metrics: ServerMetrics,
    batch_metrics: BatchMetrics, has_store: bool,
) -> Any:  # fmt: skip
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal engine
        if engine is None:
            from convoy.engine.async_engine import AsyncEngine

            logger.info("loading model %s", settings.engine.model or "(default)")
            # Loading is slow and synchronous; a thread keeps the loop responsive meanwhile.
            engine = await asyncio.to_thread(AsyncEngine, settings.engine)
        await engine.start()
        # Start-up's objects (torch, the model) are permanent: frozen, a full collection no
        # longer walks them (0.3 s a pause with SmolLM2 loaded, on a 2-core host); garbage is
        # collected first so that none of it is kept for good.
        gc.collect()
        gc.freeze()
        name = settings.served_model_name or engine.model_name
        limits = ServingLimits.of(settings)
        client = EngineClient(engine, name, limits, settings.reasoning_parser)
        metrics.attach_engine(engine.stats, lambda: client.num_in_flight)
        app.state.engine, app.state.client = engine, client
        app.state.completions, app.state.chat = CompletionServing(client), ChatServing(client)
        app.state.embeddings = EmbeddingServing(client)
        app.state.created = int(time.time())
        app.state.batch_db = _open_data_dir(settings) if has_store else None
        db = app.state.batch_db  # responses.db beside it, in the folder this process holds
        store = ResponseStore(db.root) if db is not None else None
        app.state.responses = ResponsesServing(app.state.chat, store)
        await app.state.responses.background.resume()  # what a stopped server left unfinished
        start_batches(
            app, settings, batch_metrics, local_routes(app.state), name, lines_in_flight(settings)
        )
        logger.info("serving %s (max_model_len %d)", name, engine.max_model_len)
        logger.info("playground page: open %s in a browser", page_url(settings.host, settings.port))
        try:
            yield
        finally:
            if app.state.batch_runner is not None:
                await app.state.batch_runner.stop()  # finished lines committed, the rest resume
            await app.state.responses.background.stop()  # unfinished ones resume at next start
            logger.info("shutting down the engine")
            await engine.shutdown()
            if app.state.batch_db is not None:
                app.state.batch_db.close()
            if store is not None:
                store.close()

    return lifespan


def _open_data_dir(settings: ServerConfig) -> BatchDB | None:
    """The Batch API's data folder; None (those routes answer 503) when another server holds it."""
    root = Path(settings.data_dir) if settings.data_dir else default_data_dir()
    try:
        return BatchDB(root)
    except DataDirBusy as e:
        logger.warning("files and batches are disabled: %s", e)
        return None


def build_app(
    settings: ServerConfig, engine: AsyncEngine | None = None, replica: str | None = None
) -> FastAPI:
    """The server app. The lifespan creates the engine from `settings` unless one is given.

    `replica`: this app is one of several Ray Serve replicas (convoy.cluster.serve) behind one
    endpoint: its responses carry `x-convoy-replica`, its metrics a `replica` label, and it
    keeps no Batch API store (one per replica would run a batch twice): the coordinator's app
    (build_batch_app) owns /v1/files and /v1/batches and sends each line to a replica's engine
    (`serve_line` on `app.state`).
    """
    labels = {"replica": replica} if replica is not None else None
    metrics = ServerMetrics(labels)
    batch_metrics = BatchMetrics(metrics.registry)
    app = FastAPI(
        title="Convoy",
        version=VERSION,
        summary="OpenAI-compatible LLM server with continuous batching",
        lifespan=_lifespan(settings, engine, metrics, batch_metrics, replica is None),
    )
    app.state.batch_metrics = batch_metrics
    install_error_handlers(app)
    _describe_bodies(app)
    _add_middleware(app, settings, metrics, {REPLICA_HEADER: replica} if replica else None)
    _add_generation_routes(app)
    add_response_routes(app)
    _add_info_routes(app, metrics)
    add_page_routes(app)
    if replica is None:
        add_file_routes(app, settings)
        add_batch_routes(app, settings)
    return app


def _add_middleware(
    app: FastAPI, settings: ServerConfig, metrics: ServerMetrics, headers: dict[str, str] | None
) -> None:
    # Added innermost first: the request log wraps everything, so 401 and 413 are logged too.
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_request_bytes,
        read_timeout=settings.request_body_timeout,
        self_limited=UPLOAD_ROUTES,
    )
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(RequestLogMiddleware, metrics=metrics, headers=headers)


def build_batch_app(
    settings: ServerConfig, routes: dict[str, LineRunner], model: str, window: int
) -> FastAPI:
    """The Batch API alone, with no engine: /v1/files and /v1/batches over the data folder,
    each line run by `routes` (`convoy serve --replicas`: on the engine replicas), `window`
    lines in flight, the lines naming the served model `model`."""
    metrics = ServerMetrics()
    batch_metrics = BatchMetrics(metrics.registry)  # the replicas count the lines they run

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.batch_db = _open_data_dir(settings)
        start_batches(app, settings, batch_metrics, routes, model, window)
        try:
            yield
        finally:
            if app.state.batch_runner is not None:
                await app.state.batch_runner.stop()  # finished lines committed, the rest resume
            if app.state.batch_db is not None:
                app.state.batch_db.close()

    app = FastAPI(title="Convoy Batch API", version=VERSION, lifespan=lifespan)
    install_error_handlers(app)
    _add_middleware(app, settings, metrics, None)
    add_file_routes(app, settings)
    add_batch_routes(app, settings)
    return app


def _describe_bodies(app: FastAPI) -> None:
    """Put the BODY_MODELS' schemas (validation mode, as FastAPI would) in /openapi.json.

    The routes take the raw body rather than a model parameter, so FastAPI does not see them;
    each route's requestBody refers to its model there (`_docs`).
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = FastAPI.openapi(app)
        _, defs = models_json_schema(
            [(m, "validation") for m in BODY_MODELS], ref_template=SCHEMA_REF
        )
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, sub in defs.get("$defs", {}).items():
            if schemas.setdefault(name, sub) != sub:  # a response model of the same name
                raise RuntimeError(f"two different OpenAPI schemas named {name}")
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_generation_routes(app: FastAPI) -> None:
    @app.post("/v1/completions", **docs(CompletionResponse, CompletionRequest, STREAMS))
    async def completions(request: Request) -> Response:
        body, size = await parse_body(request, CompletionRequest)
        work = app.state.completions.create(body, record(request), size)
        return await until_disconnect(request, work)

    @app.post(
        "/v1/chat/completions", **docs(ChatCompletionResponse, ChatCompletionRequest, STREAMS)
    )
    async def chat_completions(request: Request) -> Response:
        body, size = await parse_body(request, ChatCompletionRequest)
        work = app.state.chat.create(body, record(request), size)
        return await until_disconnect(request, work)

    @app.post("/v1/embeddings", **docs(EmbeddingResponse, EmbeddingRequest))
    async def embeddings(request: Request) -> Response:
        body, size = await parse_body(request, EmbeddingRequest)
        work = app.state.embeddings.create(body, record(request), size)
        return await until_disconnect(request, work)


def _add_info_routes(app: FastAPI, metrics: ServerMetrics) -> None:
    def client() -> EngineClient:
        c: EngineClient = app.state.client
        return c

    def card() -> ModelCard:
        c = client()
        return ModelCard(
            id=c.served_model_name,
            created=app.state.created,
            root=c.engine.model_name,
            max_model_len=c.max_model_len,
        )

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> ModelCard:
        client().check_model(model_id)
        return card()

    @app.post("/tokenize", **docs(TokenizeResponse, TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        body, size = await parse_body(request, TokenizeRequest)
        return await off_loop(size, _json, _tokenize, client(), body)

    @app.post("/detokenize", **docs(DetokenizeResponse, DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        body, size = await parse_body(request, DetokenizeRequest)
        return await off_loop(size, _json, _detokenize, client(), body)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if client().engine.is_running else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _json(
    fn: Callable[[EngineClient, BodyT], BaseModel], client: EngineClient, body: BodyT
) -> Response:
    """`fn`'s answer serialized: inside the same worker thread for large bodies."""
    return Response(fn(client, body).model_dump_json(), media_type="application/json")


def _detokenize(client: EngineClient, body: DetokenizeRequest) -> DetokenizeResponse:
    client.check_model(body.model)
    client.check_token_ids(body.tokens, "tokens")
    return DetokenizeResponse(prompt=client.tokenizer.decode(body.tokens))


def _tokenize(client: EngineClient, body: TokenizeRequest) -> TokenizeResponse:
    """vLLM's /tokenize: a prompt (special tokens added) or messages (through the template)."""
    client.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    tokenizer = client.tokenizer
    if body.messages is not None:
        if body.chat_template_kwargs:
            check_template_kwargs(body.chat_template_kwargs)
        check_continuation(body.continue_final_message, body.add_generation_prompt)
        text = chat_text(client, body.messages, body.add_generation_prompt, None,
                         body.chat_template_kwargs, body.continue_final_message)  # fmt: skip
        tokens = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    else:
        add_special = body.add_special_tokens is not False
        tokens = tokenizer.encode(body.prompt or "", add_special_tokens=add_special)
    strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return TokenizeResponse(
        count=len(tokens), max_model_len=client.max_model_len, tokens=tokens, token_strs=strs
    )
