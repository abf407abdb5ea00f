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

import ray
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
from serve_app.engine_client import EngineClient, unwrap_ray_error
from serve_app.engine_router import EngineRouter, merge_expositions
from serve_app.engine_sets import AutoscaledEngines, StaticEngines, replica_exposition
from serve_app.engines import engine_groups
from serve_app.http_guard import GuardError, HttpGuard
from serve_app.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
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


class ServedModel:
    """One model the ingress serves: its tokenizer, its engine replicas (fixed or autoscaled) and the OpenAI
    handlers over them."""

    def __init__(self, config: AppConfig, group: str, tokenizer_thread: ThreadPoolExecutor):
        from transformers import AutoTokenizer

        self.config = config
        settings = config.serve
        self.name = config.engine_config().model_name
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_configured_model(config.model, weights=False))
        if settings.engine_autoscaling is not None:
            self.engines: StaticEngines | AutoscaledEngines = AutoscaledEngines(
                config, group, settings.request_timeout_s
            )
        else:
            self.engines = StaticEngines(config, group)
        self.engine_info = self.engines.engine_info
        self.processor = OutputProcessor(self.tokenizer)
        router = EngineRouter(self.engines, settings.routing, settings.routing_prefix_tokens)
        self.runner = RequestRunner(router, self.processor, settings.request_timeout_s)
        self.serving = OpenAIServing(
            self.name, self.tokenizer, self.engine_info, settings, self.runner, tokenizer_thread
        )
        self.lora_enabled = config.lora.enable_lora
        if self.lora_enabled:
            clients = self.engines.all_clients()
            if clients:
                self.serving.adapters = adapters_by_name(ray.get(clients[0].engine.list_loras.remote(), timeout=60))

    def cards(self) -> list[ModelCard]:
        """The model, then its LoRA adapters (parent: the model), as vLLM lists them."""
        created, max_model_len = now(), self.engine_info.max_model_len
        cards = [ModelCard(id=self.name, created=created, root=self.config.model.name, max_model_len=max_model_len)]
        for name, adapter in self.serving.adapters.items():
            cards.append(
                ModelCard(id=name, created=created, root=adapter["path"], parent=self.name, max_model_len=max_model_len)
            )
        return cards

    async def refresh_adapters(self) -> None:
        """The adapters as the engines list them (another ingress replica may have loaded or unloaded one)."""
        clients = self.engines.routable()
        if self.lora_enabled and clients:
            self.serving.adapters = adapters_by_name(await clients[0].engine.list_loras.remote())

    async def load_adapter(self, name: str, path: str) -> None:
        """Load a LoRA adapter into every engine replica of the model; one refusing it (a bad adapter) undoes the
        others and the refusal is a 400."""
        self._require_lora()
        clients = self.engines.routable() or await self.engines.wait_for_engine()
        results = await asyncio.gather(
            *(client.engine.add_lora.remote(name, path) for client in clients), return_exceptions=True
        )
        failures = [result for result in results if isinstance(result, BaseException)]
        if failures:
            loaded = [client for client, result in zip(clients, results) if not isinstance(result, BaseException)]
            await asyncio.gather(*(client.engine.remove_lora.remote(name) for client in loaded), return_exceptions=True)
            error = unwrap_ray_error(failures[0])
            if isinstance(error, ValueError):
                raise RequestError(400, str(error), param="lora_path")
            raise error
        self.serving.adapters[name] = results[0]

    async def unload_adapter(self, name: str) -> None:
        """Unload an adapter of this model (the caller found it loaded, adapters refreshed) from every replica."""
        results = await asyncio.gather(
            *(client.engine.remove_lora.remote(name) for client in self.engines.all_clients()), return_exceptions=True
        )
        self.serving.adapters.pop(name, None)
        for result in results:
            error = unwrap_ray_error(result) if isinstance(result, BaseException) else None
            if isinstance(error, ValueError):
                raise RequestError(409, str(error), "ConflictError", "lora_name")

    def _require_lora(self) -> None:
        if not self.lora_enabled:
            raise RequestError(400, f"LoRA adapters are not enabled for {self.name}: start it with --enable-lora.")


def adapters_by_name(listed: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {adapter["name"]: adapter for adapter in listed}


class OpenAIIngress:
    """One ingress replica: speaks HTTP and text; the scheduler actors deal in token ids only."""

    def __init__(self, app_config: dict[str, Any]):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.config = AppConfig.model_validate(app_config)
        # Serve's name for this application, whoever deployed it (serve run/deploy, KubeRay, pagedserve serve).
        self.app_name = serve.get_replica_context().app_name
        self.tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self.models: dict[str, ServedModel] = {}
        for group, model_config in engine_groups(self.config, self.app_name):
            served = ServedModel(model_config, group, self.tokenizer_thread)
            self.models[served.name] = served
        self.guard = HttpGuard(self.config.serve)
        self.routes: dict[tuple[str, str], Callable[[Request], Awaitable[Response]]] = {
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("GET", "/v1/models"): self.list_models,
            ("GET", "/health"): self.health,
            ("GET", "/metrics"): self.metrics,
            ("GET", "/version"): self.version,
            ("POST", "/tokenize"): self.tokenize,
            ("POST", "/detokenize"): self.detokenize,
            ("POST", "/v1/load_lora_adapter"): self.load_lora_adapter,
            ("POST", "/v1/unload_lora_adapter"): self.unload_lora_adapter,
        }
        freeze_startup_heap("ingress replica")
        for served in self.models.values():
            logger.info(
                "ingress of application %s ready for model %s (%s)", self.app_name, served.name, served.engine_info
            )

    async def __del__(self) -> None:
        """Serve calls this when it stops the replica gracefully (delete, scale-down, redeploy, shutdown) after
        its requests drained."""
        # A replica whose __init__ failed half-way has less to release.
        for served in getattr(self, "models", {}).values():
            await served.engines.close()
        if hasattr(self, "tokenizer_thread"):
            self.tokenizer_thread.shutdown(wait=False)

    async def served_model(self, requested: str | None) -> ServedModel:
        """The model a request names, or the model whose LoRA adapter it names; with one model served, a request
        naming none goes to it. An unknown name is a 404 naming the served ones."""
        if requested is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise RequestError(400, f"model is required: this server serves {self._served_names()}", param="model")
        served = self._find(requested)
        if served is None:
            # An adapter another ingress replica loaded is not known here yet.
            await asyncio.gather(*(served.refresh_adapters() for served in self.models.values()))
            served = self._find(requested)
        if served is None:
            raise RequestError(
                404,
                f"The model `{requested}` does not exist; this server serves {self._served_names()}.",
                "NotFoundError",
                "model",
            )
        return served

    def _find(self, requested: str) -> ServedModel | None:
        if requested in self.models:
            return self.models[requested]
        return next((served for served in self.models.values() if requested in served.serving.adapters), None)

    def _served_names(self) -> list[str]:
        return [name for served in self.models.values() for name in [served.name, *served.serving.adapters]]

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
            "/v1/completions": (CompletionRequest, "complete"),
            "/v1/chat/completions": (ChatCompletionRequest, "chat"),
        }
        try:
            if route not in handlers:
                raise RequestError(404, f"batch requests go to {sorted(handlers)}, not {route!r}", "NotFoundError")
            model, handler_name = handlers[route]
            body = validate_payload(model, payload)
            if body.stream:
                raise RequestError(400, "stream is not supported in batch requests.", param="stream")
            served = await self.served_model(body.model)
            response = self._respond(await getattr(served.serving, handler_name)(body), served)
        except (RequestError, *ENGINE_ERRORS) as error:
            response = error_response(error)
        return response.status_code, json.loads(response.body)

    def _all_clients(self) -> list[EngineClient]:
        return [client for served in self.models.values() for client in served.engines.all_clients()]

    async def request_state(self) -> dict[str, int]:
        """Per-request state this replica holds, all zero when idle, and its memory (soak leak checks)."""
        clients = self._all_clients()
        return {
            "detokenizers": sum(len(served.processor.requests) for served in self.models.values()),
            "output_queues": sum(client.num_in_flight for client in clients),
            "pending_aborts": sum(len(client.pending_aborts) for client in clients),
            "rss_bytes": process_rss_bytes(),
        }

    async def check_health(self) -> None:
        """Ray Serve calls this; raising marks the replica unhealthy so Serve replaces it. A scheduler actor that is
        rebuilding its workers, or that this replica is replacing, does not count (its /health says 503 meanwhile)."""
        for served in self.models.values():
            served.engines.ensure_running()
        await asyncio.gather(*(client.ping() for client in self._all_clients()))

    async def _check_engines(self) -> None:
        await asyncio.gather(*(client.check_health() for client in self._all_clients()))

    async def health(self, request: Request) -> Response:
        try:
            await asyncio.wait_for(self._check_engines(), 10)
        except Exception as error:
            body = error_body(f"engine unhealthy: {error}", "ServiceUnavailableError", 503)
            return JSONResponse(body, status_code=503)
        return Response(status_code=200)

    async def list_models(self, request: Request) -> Response:
        await asyncio.gather(*(served.refresh_adapters() for served in self.models.values()))
        return self._respond(ModelList(data=[card for served in self.models.values() for card in served.cards()]))

    async def load_lora_adapter(self, request: Request) -> Response:
        body = await parse_body(request, LoadLoRAAdapterRequest, self.guard)
        if len(self.models) > 1 and body.base_model_name is None:
            raise RequestError(
                400, f"base_model_name is required: this server serves {list(self.models)}", param="base_model_name"
            )
        served = self.models.get(body.base_model_name) if body.base_model_name else next(iter(self.models.values()))
        if served is None:
            raise RequestError(404, f"no model {body.base_model_name!r}; served: {list(self.models)}", "NotFoundError")
        if self._find(body.lora_name) is not None:
            raise RequestError(400, f"the name {body.lora_name!r} is already served.", param="lora_name")
        await served.load_adapter(body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        body = await parse_body(request, UnloadLoRAAdapterRequest, self.guard)
        await asyncio.gather(*(served.refresh_adapters() for served in self.models.values()))
        served = next((served for served in self.models.values() if body.lora_name in served.serving.adapters), None)
        if served is None:
            raise RequestError(
                404, f"no LoRA adapter named {body.lora_name!r} is loaded.", "NotFoundError", "lora_name"
            )
        await served.unload_adapter(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    async def metrics(self, request: Request) -> Response:
        results = await asyncio.gather(
            *(client.engine.metrics_text.remote() for client in self._all_clients()), return_exceptions=True
        )
        # An engine that is down drops out of the scrape; the others still report.
        expositions = [result for result in results if isinstance(result, bytes)]
        expositions.append(
            replica_exposition({name: served.engines.replica_counts() for name, served in self.models.items()})
        )
        return Response(merge_expositions(expositions), media_type=CONTENT_TYPE_LATEST)

    async def version(self, request: Request) -> Response:
        return self._respond(VersionResponse(version=PAGEDSERVE_VERSION))

    async def tokenize(self, request: Request) -> Response:
        body = await parse_body(request, TokenizeRequest, self.guard)
        served = await self.served_model(body.model)
        return self._respond(await served.serving.tokenize(body), served)

    async def detokenize(self, request: Request) -> Response:
        body = await parse_body(request, DetokenizeRequest, self.guard)
        served = await self.served_model(body.model)
        return self._respond(served.serving.detokenize(body), served)

    async def completions(self, request: Request) -> Response:
        body = await parse_body(request, CompletionRequest, self.guard)
        served = await self.served_model(body.model)
        return self._respond(await served.serving.complete(body), served)

    async def chat_completions(self, request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest, self.guard)
        served = await self.served_model(body.model)
        return self._respond(await served.serving.chat(body), served)

    def _respond(self, result: BaseModel | ChunkStream, served: ServedModel | None = None) -> Response:
        if isinstance(result, ChunkStream):
            return self._stream(result, served.runner)
        return Response(result.model_dump_json(), media_type="application/json")

    def _stream(self, stream: ChunkStream, runner: RequestRunner) -> StreamingResponse:
        """SSE: one event per chunk, an error event if the request fails midway, then `[DONE]`."""

        async def events() -> AsyncIterator[str]:
            try:
                async with runner.deadline(), contextlib.aclosing(stream.chunks) as chunks:
                    async for chunk in chunks:
                        yield sse(chunk.model_dump_json())
            except TimeoutError:
                yield sse(error_status_and_body(runner.timeout_error())[1])
            except (RequestError, EngineDeadError) as error:
                yield sse(error_status_and_body(error)[1])
            yield sse("[DONE]")

        return ReleasingStreamingResponse(events(), functools.partial(runner.release, stream.submissions))


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
