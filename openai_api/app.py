"""The ASGI application: the OpenAI routes, each a thin step over translate -> queue service
(``Generation``) -> render.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models[/<id>]   GET /health

The key's tier is the ``x-tierflow-tier`` header that the gateway set (Envoy's ext_authz), and
its label ``x-tierflow-key-id``, which scopes the request's id to the key; this service is
reachable only behind Envoy. A client that goes away cancels its request, streamed
or not: the Generate call is cancelled, and the queue service stops the prefill at the next
layer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from openai_api.config import OpenAIApiConfig
from openai_api.errors import OpenAIError, bad_request, error_body
from openai_api.generation import KEEP_ALIVE, Generation
from openai_api.render import DONE_EVENT, Renderer
from openai_api.service_tiers import ServiceTiers
from openai_api.translate import Plan, ServedModel, chat_plan, check_model, completion_plan
from tierflow.client import AsyncTierflowClient
from tierflow.identity import Identity, Role, TlsFiles
from tierflow.tiers import KEY_ID_HEADER, KEY_WEIGHT_HEADER, REQUESTED_TIER_HEADER, TIER_HEADER

log = structlog.get_logger("openai_api")

T = TypeVar("T")
REQUEST_ID_HEADER = "x-tierflow-request-id"  # the queue service's id of the request, in logs


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


class OpenAIApi:
    """The routes, over one gRPC channel to the queue service (opened in the app's loop)."""

    def __init__(self, config: OpenAIApiConfig, served: ServedModel, tiers: ServiceTiers) -> None:
        self.config = config
        self.served = served
        self.tiers = tiers
        self.queue: AsyncTierflowClient | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        credentials = None
        if self.config.tls_dir is not None:
            tls = TlsFiles.load(self.config.tls_dir, Identity(Role.OPENAI_API))
            credentials = tls.channel_credentials()
        self.queue = AsyncTierflowClient(self.config.queue_service, credentials=credentials)
        log.info(
            "openai api ready",
            listen=self.config.listen,
            model=self.served.name,
            queue_service=self.config.queue_service,
        )
        try:
            yield
        finally:
            await self.queue.close()

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/health", lambda _: PlainTextResponse("ok"), methods=["GET"]),
            ],
            exception_handlers={OpenAIError: _openai_error, HTTPException: _http_error},
            lifespan=self.lifespan,
        )

    # ------------------------------------------------------------ routes

    async def chat_completions(self, request: Request) -> Response:
        plan = chat_plan(await _json(request), self.served, self.config.chat_default_max_tokens)
        return await self._generate(request, plan)

    async def completions(self, request: Request) -> Response:
        body = await _json(request)
        plan = completion_plan(body, self.served, self.config.completion_default_max_tokens)
        return await self._generate(request, plan)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        check_model(request.path_params["model"], self.served)
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {
            "id": self.served.name,
            "object": "model",
            "created": self.served.created,
            "owned_by": "tierflow",
        }

    # ------------------------------------------------------------ generation

    async def _generate(self, request: Request, plan: Plan) -> Response:
        tier = self.tiers.resolve(request.headers.get(TIER_HEADER), plan.service_tier)
        request_id = uuid.uuid4().hex
        call = self.queue.generate(
            plan.prompt_ids,
            tier=tier,
            # The key's label (set by the gateway): the request is in that key's scope, so its
            # id (x-tierflow-request-id) means nothing to any other key.
            key_id=request.headers.get(KEY_ID_HEADER),
            key_weight=request.headers.get(KEY_WEIGHT_HEADER),
            max_new_tokens=plan.max_new_tokens,
            temperature=plan.temperature,
            top_p=plan.top_p,
            seed=plan.seed,
            request_id=request_id,
        )
        generation = Generation(call, plan.stops, retry_after_s=self.config.retry_after_s)
        log_ = log.bind(request_id=request_id, tier=tier, kind=plan.kind, stream=plan.stream)
        try:
            if plan.stream:
                await _unless_client_goes(request, generation.start())
            else:
                text = await _unless_client_goes(request, generation.text())
        except ClientGone:
            generation.close()
            log_.info("client gone, cancelled")
            return Response(status_code=499)  # nobody reads it
        except OpenAIError as exc:
            generation.close()
            log_.info("refused", status=exc.status, message=exc.message)
            exc.headers[REQUEST_ID_HEADER] = request_id
            raise
        renderer = Renderer(
            plan.kind,
            request_id,
            self.served.name,
            self.tiers.openai_name(generation.tier or tier),
            plan.include_usage,
        )
        headers = {TIER_HEADER: generation.tier or tier, REQUEST_ID_HEADER: request_id}
        if generation.requested_tier:  # served below the tier asked for: its tier was full
            headers[REQUESTED_TIER_HEADER] = generation.requested_tier
        if plan.stream:
            return StreamingResponse(
                _events(generation, renderer, log_),
                media_type="text/event-stream",
                headers=headers | {"cache-control": "no-cache"},
            )
        usage = generation.usage
        log_.info("answered", finish_reason=generation.finish_reason, **usage.as_dict())
        body = renderer.response(text, generation.finish_reason or "length", usage)
        return JSONResponse(body, headers=headers)


KEEP_ALIVE_COMMENT = ": waiting in the queue\n\n"


async def _events(generation: Generation, renderer: Renderer, log_) -> AsyncIterator[str]:
    """The SSE body. Cancelled when the client disconnects (Starlette listens for it): the
    ``finally`` then cancels the Generate call."""
    try:
        if renderer.kind == "chat":
            yield renderer.chunk(role=True)
        async for piece in generation.pieces():
            # A keep-alive is an SSE comment: clients skip it, and proxies see the stream live.
            yield renderer.chunk(piece) if piece != KEEP_ALIVE else KEEP_ALIVE_COMMENT
        yield renderer.chunk(finish_reason=generation.finish_reason)
        if renderer.include_usage:
            yield renderer.usage_chunk(generation.usage)
        yield DONE_EVENT
        log_.info("streamed", finish_reason=generation.finish_reason, **generation.usage.as_dict())
    except OpenAIError as exc:
        log_.warning("failed while streaming", status=exc.status, message=exc.message)
        yield renderer.error_event(exc)
    finally:
        if generation.finish_reason is None:
            log_.info("stream closed early, cancelled")
        generation.close()


async def _unless_client_goes(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or ClientGone as soon as the client disconnects (``work`` is then
    cancelled). Starlette does this for a streamed body; this covers the wait before it."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled itself (shutdown)
        watcher.cancel()
        gone = not task.done()
        if gone:
            task.cancel()
    if gone:
        raise ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _json(request: Request):
    try:
        return json.loads(await request.body())
    except ValueError:
        raise bad_request("the request body is not valid JSON") from None


async def _openai_error(request: Request, exc: OpenAIError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code)
