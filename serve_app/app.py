"""The OpenAI-compatible Ray Serve ingress: routes, HTTP hygiene, errors as OpenAI error bodies, JSON and SSE.

`build_app(config)` returns the bound application; the same import path serves `serve run`, `serve deploy`
and a KubeRay serveConfigV2: `import_path: serve_app.app:build_app`. The application's name and route prefix are
whatever Serve runs it under: the replica reads them from Serve, never from its args.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from configs.app_config import AppConfig
from executor.engine_actor import process_rss_bytes
from executor.errors import EngineDeadError, EngineDrainingError, EngineOverloadedError
from executor.heap import freeze_startup_heap
from executor.output_processor import OutputProcessor
from model_executor.model_fetch import resolve_configured_model
from serve_app.engine_client import EngineClient
from serve_app.engine_router import EngineRouter, merge_expositions
from serve_app.engines import attach_engines, detach_engines, engine_creators
from serve_app.http_guard import GuardError, HttpGuard
from serve_app.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    VersionResponse,
    error_body,
    now,
)
from serve_app.request_runner import RequestRunner
from serve_app.serving import ChunkStream, OpenAIServing
from serve_app.validation import RequestError, parse_body, validate_payload

logger = logging.getLogger(__name__)

PAGEDSERVE_VERSION = "0.1.0"
ENGINE_ERRORS = (EngineOverloadedError, EngineDrainingError, EngineDeadError)


def error_status_and_body(
    error: RequestError | EngineOverloadedError | EngineDrainingError | EngineDeadError,
) -> tuple[int, dict[str, Any]]:
    """The one mapping of a refused request or an engine failure to (HTTP status, OpenAI error body)."""
    if isinstance(error, RequestError):
        return error.status, error_body(error.message, error.error_type, error.status, error.param)
    if isinstance(error, EngineDeadError):
        return 503, error_body(f"the engine is unavailable: {error}", "ServiceUnavailableError", 503)
    return 503, error_body(str(error), "ServiceUnavailableError", 503)


def error_response(error: RequestError | EngineOverloadedError | EngineDrainingError | EngineDeadError) -> Response:
    status, body = error_status_and_body(error)
    response = JSONResponse(body, status_code=status)
    if isinstance(error, EngineOverloadedError):
        response.headers["Retry-After"] = "1"
    return response


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class ReleasingStreamingResponse(StreamingResponse):
    """SSE that releases its engine requests however the response ends, even when the client left before the
    first byte (then Starlette never iterates the body and the generator's own cleanup never runs)."""

    def __init__(self, content: AsyncIterator[str], release: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream")
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


class OpenAIIngress:
    """One ingress replica: speaks HTTP and text; the scheduler actor deals in token ids only."""

    def __init__(self, app_config: dict[str, Any]):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from transformers import AutoTokenizer

        self.config = AppConfig.model_validate(app_config)
        # Serve's name for this application, whoever deployed it (serve run/deploy, KubeRay, pagedserve serve).
        self.app_name = serve.get_replica_context().app_name
        settings = self.config.serve
        engine_config = self.config.engine_config()
        self.model_name = engine_config.model_name
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_configured_model(self.config.model, weights=False))
        self.clients = [
            EngineClient(create(), create, engine_config.runtime.transport)
            for create in engine_creators(self.config, self.app_name)
        ]
        self.engine_info = attach_engines(self.clients, engine_config)
        self.tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self.processor = OutputProcessor(self.tokenizer)
        router = EngineRouter(self.clients, settings.routing, settings.routing_prefix_tokens)
        self.runner = RequestRunner(router, self.processor, settings.request_timeout_s)
        self.serving = OpenAIServing(
            self.model_name, self.tokenizer, self.engine_info, settings, self.runner, self.tokenizer_thread
        )
        self.guard = HttpGuard(settings)
        self.routes: dict[tuple[str, str], Callable[[Request], Awaitable[Response]]] = {
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("GET", "/v1/models"): self.list_models,
            ("GET", "/health"): self.health,
            ("GET", "/metrics"): self.metrics,
            ("GET", "/version"): self.version,
            ("POST", "/tokenize"): self.tokenize,
            ("POST", "/detokenize"): self.detokenize,
        }
        freeze_startup_heap("ingress replica")
        logger.info(
            "ingress of application %s ready for model %s (%s)", self.app_name, self.model_name, self.engine_info
        )

    async def __del__(self) -> None:
        """Serve calls this when it stops the replica gracefully (delete, scale-down, redeploy, shutdown) after
        its requests drained."""
        # A replica whose __init__ failed half-way has less to release.
        await detach_engines(getattr(self, "clients", []))
        if hasattr(self, "tokenizer_thread"):
            self.tokenizer_thread.shutdown(wait=False)

    @staticmethod
    def route_path(request: Request) -> str:
        """The ASGI scope path below the app's mount point: what routing and auth both decide on.

        Serve's proxy and a direct-ingress replica both put the route prefix (after any http_options.root_path) in
        the scope's root_path and keep it in path, as ASGI says.
        """
        path = request.scope.get("path", "/")
        root_path = request.scope.get("root_path", "").rstrip("/")
        if root_path and path.startswith(root_path + "/"):
            return path[len(root_path) :]
        return "/" if path == root_path else path

    async def __call__(self, request: Request) -> Response:
        path = self.route_path(request)
        # X-Request-Id is echoed (or generated) by Ray Serve's own middleware.
        extra_headers = self.guard.cors_headers(request)
        if request.method == "OPTIONS":
            return self.guard.preflight(request)
        try:
            self.guard.check_headers(request)
            self.guard.check_auth(path, request)
            handler = self.routes.get((request.method, path))
            if handler is None:
                known = sorted({route_path for _, route_path in self.routes})
                status = 405 if any(route_path == path for _, route_path in self.routes) else 404
                raise RequestError(status, f"no route {request.method} {path}; routes: {known}", "NotFoundError")
            response = await handler(request)
        except GuardError as error:
            response = error.response()
        except (RequestError, *ENGINE_ERRORS) as error:
            response = error_response(error)
        response.headers.update(extra_headers)
        return response

    async def process_body(self, route: str, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """One non-streamed OpenAI request body through a DeploymentHandle (batch jobs): (HTTP status, JSON).

        Same validation, engine path and error shapes as over HTTP, without an HTTP hop.
        """
        handlers = {
            "/v1/completions": (CompletionRequest, self.serving.complete),
            "/v1/chat/completions": (ChatCompletionRequest, self.serving.chat),
        }
        try:
            if route not in handlers:
                raise RequestError(404, f"batch requests go to {sorted(handlers)}, not {route!r}", "NotFoundError")
            model, handler = handlers[route]
            body = validate_payload(model, payload)
            if body.stream:
                raise RequestError(400, "stream is not supported in batch requests.", param="stream")
            response = self._respond(await handler(body))
        except (RequestError, *ENGINE_ERRORS) as error:
            response = error_response(error)
        return response.status_code, json.loads(response.body)

    async def request_state(self) -> dict[str, int]:
        """Per-request state this replica holds, all zero when idle, and its memory (soak leak checks)."""
        return {
            "detokenizers": len(self.processor.requests),
            "output_queues": sum(client.num_in_flight for client in self.clients),
            "pending_aborts": sum(len(client.pending_aborts) for client in self.clients),
            "rss_bytes": process_rss_bytes(),
        }

    async def check_health(self) -> None:
        """Ray Serve calls this; raising marks the replica unhealthy so Serve replaces it. A scheduler actor that is
        rebuilding its workers, or that this replica is replacing, does not count (its /health says 503 meanwhile)."""
        await asyncio.gather(*(client.ping() for client in self.clients))

    async def _check_engines(self) -> None:
        await asyncio.gather(*(client.check_health() for client in self.clients))

    async def health(self, request: Request) -> Response:
        try:
            await asyncio.wait_for(self._check_engines(), 10)
        except Exception as error:
            body = error_body(f"engine unhealthy: {error}", "ServiceUnavailableError", 503)
            return JSONResponse(body, status_code=503)
        return Response(status_code=200)

    async def list_models(self, request: Request) -> Response:
        card = ModelCard(id=self.model_name, created=now(), max_model_len=self.engine_info.max_model_len)
        return self._respond(ModelList(data=[card]))

    async def metrics(self, request: Request) -> Response:
        results = await asyncio.gather(
            *(client.engine.metrics_text.remote() for client in self.clients), return_exceptions=True
        )
        # An engine that is down drops out of the scrape; the others still report.
        expositions = [result for result in results if isinstance(result, bytes)]
        return Response(merge_expositions(expositions), media_type=CONTENT_TYPE_LATEST)

    async def version(self, request: Request) -> Response:
        return self._respond(VersionResponse(version=PAGEDSERVE_VERSION))

    async def tokenize(self, request: Request) -> Response:
        body = await parse_body(request, TokenizeRequest, self.guard)
        return self._respond(await self.serving.tokenize(body))

    async def detokenize(self, request: Request) -> Response:
        body = await parse_body(request, DetokenizeRequest, self.guard)
        return self._respond(self.serving.detokenize(body))

    async def completions(self, request: Request) -> Response:
        body = await parse_body(request, CompletionRequest, self.guard)
        return self._respond(await self.serving.complete(body))

    async def chat_completions(self, request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest, self.guard)
        return self._respond(await self.serving.chat(body))

    def _respond(self, result: BaseModel | ChunkStream) -> Response:
        if isinstance(result, ChunkStream):
            return self._stream(result)
        return JSONResponse(result.model_dump())

    def _stream(self, stream: ChunkStream) -> StreamingResponse:
        """SSE: one event per chunk, an error event if the request fails midway, then `[DONE]`."""

        async def events() -> AsyncIterator[str]:
            try:
                async with self.runner.deadline(), contextlib.aclosing(stream.chunks) as chunks:
                    async for chunk in chunks:
                        yield sse(chunk.model_dump())
            except TimeoutError:
                yield sse(error_status_and_body(self.runner.timeout_error())[1])
            except (RequestError, EngineDeadError) as error:
                yield sse(error_status_and_body(error)[1])
            yield sse("[DONE]")

        return ReleasingStreamingResponse(events(), functools.partial(self.runner.release, stream.submissions))


def build_app(config: AppConfig | dict[str, Any] | str | Path | None = None) -> serve.Application:
    """The bound Serve application. `config` is an AppConfig, a YAML path, or a Serve builder's `args`: sections
    nested or keys flat under vLLM's names, strings from `serve run IMPORT_PATH key=value` read as their keys'
    types, optionally over a preset (`config=configs/default.yaml`); see `AppConfig.from_serve_args`.

    The Serve application name and route prefix are those Serve deploys it under (`name`/`route_prefix` of a Serve
    config, `serve run --name/--route-prefix`, `serve.run(name=..., route_prefix=...)`), not `serve.app_name`.
    """
    if config is None:
        config = AppConfig()
    elif isinstance(config, str | Path):
        config = AppConfig.from_yaml(config)
    elif isinstance(config, dict):
        config = AppConfig.from_serve_args(config)
    scaling = (
        {"autoscaling_config": config.serve.autoscaling_config}
        if config.serve.autoscaling_config
        else {"num_replicas": config.serve.ingress_replicas}
    )
    deployment = serve.deployment(OpenAIIngress, name="OpenAIIngress").options(
        **scaling,
        max_ongoing_requests=config.serve.max_ongoing_requests,
        ray_actor_options={"num_cpus": config.serve.ingress_num_cpus},
        health_check_period_s=10,
        health_check_timeout_s=30,
    )
    return deployment.bind(config.model_dump())
