"""The OpenAI-compatible Ray Serve ingress: HTTP, validation, chat template, tokenization, detokenization, SSE.

`build_app(config)` returns the bound application; the same import path serves `serve run`, `serve deploy`
and a KubeRay serveConfigV2: `import_path: serve_app.app:build_app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from configs.app_config import AppConfig
from configs.sampling_params import SamplingParams
from executor.engine_actor import process_rss_bytes
from executor.engine_core import validate_prompt
from executor.errors import EngineDeadError, EngineDrainingError, EngineOverloadedError, short_reason
from executor.heap import freeze_startup_heap
from executor.output_processor import OutputProcessor, RequestState
from model_executor.model_fetch import resolve_model
from serve_app.engine_client import EngineClient
from serve_app.engine_router import EngineRouter, merge_expositions
from serve_app.engines import get_or_create_engine
from serve_app.http_guard import GuardError, HttpGuard
from serve_app.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LogprobFormatter,
    TokenizeRequest,
    error_body,
    message_text,
    now,
    random_id,
    usage,
)

logger = logging.getLogger(__name__)

ENGINE_READY_TIMEOUT_S = 600.0
DETACH_TIMEOUT_S = 10.0
# Only a JSON text with a \uD800-\uDFFF escape can hold a lone surrogate once strictly decoded as UTF-8.
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class RequestError(Exception):
    """A client error: becomes an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, error_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.param = status, message, error_type, param


def error_response(status: int, message: str, error_type: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, status, param), status_code=status)


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


SAMPLING_FIELDS = frozenset(field.name for field in dataclasses.fields(SamplingParams))
PAGEDSERVE_VERSION = "0.1.0"


def parameter_named_in(message: str) -> str | None:
    """The request parameter an engine error message starts with, for the error's `param`."""
    first_word = message.split(" ", 1)[0]
    return first_word if first_word in SAMPLING_FIELDS else None


def validate_payload(model: type[BaseModel], payload: Any) -> Any:
    """A JSON object -> the request model, or a 400 naming the first bad field (never pydantic's 422)."""
    if not isinstance(payload, dict):
        raise RequestError(400, "request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise RequestError(400, f"{param}: {first['msg']}", param=param) from error


def lone_surrogate_path(payload: Any) -> str | None:
    """Where the first string (key or value) with a lone UTF-16 surrogate is: no tokenizer can encode one."""
    stack: list[tuple[str, Any]] = [("", payload)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                stack += [(f"{path}.{key}" if path else str(key), key), (f"{path}.{key}" if path else str(key), item)]
        elif isinstance(value, list):
            stack += [(f"{path}.{index}" if path else str(index), item) for index, item in enumerate(value)]
    return None


async def parse_body(request: Request, model: type[BaseModel], guard: HttpGuard) -> Any:
    raw = await guard.read_json_body(request)
    try:
        # JSON between systems is UTF-8 (RFC 8259); strict decoding also refuses UTF-8-encoded surrogates.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise RequestError(400, f"request body is not valid UTF-8: {error}") from error
    try:
        payload = json.loads(text)
    except (ValueError, RecursionError) as error:
        # ValueError also covers integers past Python's digit limit; RecursionError, nesting past the parser's.
        raise RequestError(400, f"request body is not valid JSON: {error}") from error
    if SURROGATE_ESCAPE.search(text):
        path = lone_surrogate_path(payload)
        if path is not None:
            raise RequestError(400, f"{path}: a string holds a lone UTF-16 surrogate escape.", param=path)
    return validate_payload(model, payload)


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


@dataclass(slots=True)
class Submission:
    """A prompt queued in an engine replica, with the detokenizing state that follows it."""

    request_id: str
    prompt_index: int
    client: EngineClient
    state: RequestState


class OpenAIIngress:
    """One ingress replica: speaks HTTP and text; the scheduler actor deals in token ids only."""

    def __init__(self, app_config: dict[str, Any]):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from transformers import AutoTokenizer

        self.config = AppConfig.model_validate(app_config)
        self.model_name = self.config.engine_config().model_name
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model(self.config.model.name))
        settings = self.config.serve
        creators = [functools.partial(get_or_create_engine, self.config, i) for i in range(settings.engine_replicas)]
        transport = self.config.engine_config().transport
        self.clients = [EngineClient(create(), create, transport) for create in creators]
        infos = [self._attach(client) for client in self.clients]
        # Replicas may differ in KV capacity; validate against the strictest.
        self.engine_info = min(infos, key=lambda info: info["max_model_len"])
        # Tokenization (which releases the GIL) runs here, so a long prompt does not stall every other stream.
        self.tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self.max_prompt_chars = self._max_prompt_chars()
        special = sorted(
            {token.content for token in self.tokenizer.added_tokens_decoder.values() if token.special},
            key=len,
            reverse=True,
        )
        self.special_token_text = re.compile("|".join(map(re.escape, special))) if special else None
        self.router = EngineRouter(self.clients, settings.routing, settings.routing_prefix_tokens)
        self.processor = OutputProcessor(self.tokenizer)
        self.guard = HttpGuard(self.config.serve)
        self.logprobs = LogprobFormatter(self.tokenizer)
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
        logger.info("ingress ready for model %s (%s)", self.model_name, self.engine_info)

    def _attach(self, client: EngineClient) -> dict[str, Any]:
        """Adopt the engine by name. One running another config (a redeploy) is replaced; one that is ending
        (its last ingress just left) is waited out and created anew."""
        wanted = self.config.engine_config().model_dump()
        deadline = time.monotonic() + ENGINE_READY_TIMEOUT_S
        while True:
            try:
                info = ray.get(client.engine.attach.remote(client.client_id), timeout=ENGINE_READY_TIMEOUT_S)
                if info["engine_config"] == wanted:
                    return info
                logger.warning("the running engine has another config; replacing it")
                ray.kill(client.engine)
            except (ray.exceptions.RayActorError, EngineDrainingError) as error:
                logger.warning("engine not available (%s); creating it again", short_reason(error))
            if time.monotonic() > deadline:
                raise TimeoutError(f"no engine within {ENGINE_READY_TIMEOUT_S:.0f} s")
            # A killed actor's name is freed a moment after it dies.
            time.sleep(0.2)
            client.engine = client.create_engine()

    async def __del__(self) -> None:
        """Serve calls this when it stops the replica gracefully (delete, scale-down, redeploy, shutdown) after
        its requests drained: detach, so the last replica to go ends the engines, workers and placement groups."""
        # A replica whose __init__ failed half-way has less to release.
        for client in getattr(self, "clients", []):
            try:
                await asyncio.wait_for(client.engine.detach.remote(client.client_id), DETACH_TIMEOUT_S)
            except ray.exceptions.RayActorError:
                pass  # the engine already ended (it may end before its answer to the last detach arrives)
            except Exception as error:
                logger.warning("detaching from the engine failed: %s", short_reason(error))
        if hasattr(self, "tokenizer_thread"):
            self.tokenizer_thread.shutdown(wait=False)

    def _max_prompt_chars(self) -> int | None:
        """Characters past which a prompt cannot fit the context whatever it says, so it is refused untokenized.

        With byte-level vocabularies and no normalizer a token covers at most as many characters as its vocabulary
        string is long; for other tokenizers there is no such bound and every prompt is tokenized.
        """
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None:
            return None
        return self.engine_info["max_model_len"] * max(len(token) for token in self.tokenizer.get_vocab())

    def _check_prompt_chars(self, num_chars: int, param: str) -> None:
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            max_model_len = self.engine_info["max_model_len"]
            raise RequestError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                f"{num_chars} characters, more than {max_model_len} tokens can hold. Please reduce the length of "
                "the input.",
                param=param,
            )

    async def _tokenizing(self, function: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, function, *args)

    def route_path(self, request: Request) -> str:
        """The ASGI scope path minus this app's route prefix: what routing and auth both decide on."""
        path = request.scope.get("path", "/")
        # Under a route prefix (several apps on one Serve proxy) routes are matched after it.
        prefix = self.config.serve.route_prefix.rstrip("/")
        if prefix and path.startswith(prefix + "/"):
            path = path[len(prefix) :]
        return path

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
        except RequestError as error:
            response = error_response(error.status, error.message, error.error_type, error.param)
        except EngineOverloadedError as error:
            response = error_response(503, str(error), "ServiceUnavailableError")
            response.headers["Retry-After"] = "1"
        except EngineDrainingError as error:
            response = error_response(503, str(error), "ServiceUnavailableError")
        except EngineDeadError as error:
            response = error_response(503, f"the engine is unavailable: {error}", "ServiceUnavailableError")
        response.headers.update(extra_headers)
        return response

    async def process_body(self, route: str, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """One non-streamed OpenAI request body through a DeploymentHandle (batch jobs): (HTTP status, JSON).

        Same validation, engine path and error shapes as over HTTP, without an HTTP hop.
        """
        handlers = {
            "/v1/completions": (CompletionRequest, self.complete),
            "/v1/chat/completions": (ChatCompletionRequest, self.chat),
        }
        try:
            if route not in handlers:
                raise RequestError(404, f"batch requests go to {sorted(handlers)}, not {route!r}", "NotFoundError")
            model, handler = handlers[route]
            body = validate_payload(model, payload)
            if body.stream:
                raise RequestError(400, "stream is not supported in batch requests.", param="stream")
            response = await handler(body)
        except RequestError as error:
            response = error_response(error.status, error.message, error.error_type, error.param)
        except (EngineOverloadedError, EngineDrainingError) as error:
            response = error_response(503, str(error), "ServiceUnavailableError")
        except EngineDeadError as error:
            response = error_response(503, f"the engine is unavailable: {error}", "ServiceUnavailableError")
        return response.status_code, json.loads(response.body)

    async def request_state(self) -> dict[str, int]:
        """Per-request state this replica holds, all zero when idle, and its memory (soak leak checks)."""
        return {
            "detokenizers": len(self.processor.requests),
            "output_queues": sum(client.num_in_flight for client in self.clients),
            "pending_aborts": sum(len(client.pending_aborts) for client in self.clients),
            "rss_bytes": process_rss_bytes(),
        }

    async def _check_engines(self) -> None:
        await asyncio.gather(*(client.check_health() for client in self.clients))

    async def check_health(self) -> None:
        """Ray Serve calls this; raising marks the replica unhealthy so Serve replaces it. A scheduler actor that is
        rebuilding its workers, or that this replica is replacing, does not count (its /health says 503 meanwhile)."""
        await asyncio.gather(*(client.ping() for client in self.clients))

    async def health(self, request: Request) -> Response:
        try:
            await asyncio.wait_for(self._check_engines(), 10)
        except Exception as error:
            return error_response(503, f"engine unhealthy: {error}", "ServiceUnavailableError")
        return Response(status_code=200)

    async def list_models(self, request: Request) -> Response:
        model = {"id": self.model_name, "object": "model", "created": now(), "owned_by": "pagedserve"}
        model["max_model_len"] = self.engine_info["max_model_len"]
        return JSONResponse({"object": "list", "data": [model]})

    async def metrics(self, request: Request) -> Response:
        results = await asyncio.gather(
            *(client.engine.metrics_text.remote() for client in self.clients), return_exceptions=True
        )
        # An engine that is down drops out of the scrape; the others still report.
        expositions = [result for result in results if isinstance(result, bytes)]
        return Response(merge_expositions(expositions), media_type=CONTENT_TYPE_LATEST)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": PAGEDSERVE_VERSION})

    async def tokenize(self, request: Request) -> Response:
        body: TokenizeRequest = await parse_body(request, TokenizeRequest, self.guard)
        self._check_model(body.model)
        self._refuse_request_templates(body)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError(400, "give exactly one of prompt or messages.", param="prompt")
        if body.messages is not None:
            token_ids = await self._tokenizing(
                self._render_chat, body.messages, body.add_generation_prompt, body.continue_final_message
            )
        else:
            token_ids = await self._tokenizing(
                functools.partial(self.tokenizer.encode, add_special_tokens=body.add_special_tokens), body.prompt
            )
        return JSONResponse(
            {"count": len(token_ids), "max_model_len": self.engine_info["max_model_len"], "tokens": token_ids}
        )

    async def detokenize(self, request: Request) -> Response:
        body: DetokenizeRequest = await parse_body(request, DetokenizeRequest, self.guard)
        self._check_model(body.model)
        vocab_size = self.engine_info["vocab_size"]
        bad = [token_id for token_id in body.tokens if not 0 <= token_id < vocab_size]
        if bad:
            raise RequestError(400, f"token id {bad[0]} is out of the vocabulary (size {vocab_size}).", param="tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(body.tokens)})

    @staticmethod
    def _refuse_request_templates(body: BaseModel) -> None:
        """Only the model's own chat template renders prompts: one from the request could emit any control token."""
        for refused in ("chat_template", "chat_template_kwargs"):
            if (body.model_extra or {}).get(refused) is not None:
                raise RequestError(400, f"{refused} from the request is not accepted.", param=refused)

    def _check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise RequestError(404, f"The model `{requested}` does not exist.", "NotFoundError", "model")

    def _sampling_params(self, body: Any, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        settings = self.config.serve
        if body.n > settings.max_n:
            raise RequestError(400, f"n must be at most {settings.max_n}, got {body.n}.", param="n")
        if body.logit_bias and len(body.logit_bias) > settings.max_logit_bias_entries:
            raise RequestError(
                400,
                f"logit_bias may have at most {settings.max_logit_bias_entries} entries, got {len(body.logit_bias)}.",
                param="logit_bias",
            )
        if body.stream_options is not None and not body.stream:
            raise RequestError(400, "stream_options can only be set when stream is true.", param="stream_options")
        try:
            return body.sampling_params(max_tokens, logprobs)
        except ValueError as error:
            raise RequestError(400, str(error), param=parameter_named_in(str(error))) from error

    async def _completion_prompts(self, prompt: Any) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif not prompt:
            raise RequestError(400, "prompt must not be empty.", param="prompt")
        elif all(isinstance(item, int) for item in prompt):
            return [(None, list(prompt))]
        if all(isinstance(item, str) for item in prompt):
            for text in prompt:
                self._check_prompt_chars(len(text), "prompt")
            token_ids = await self._tokenizing(lambda: [self.tokenizer.encode(text) for text in prompt])
            return list(zip(prompt, token_ids))
        return [(None, list(item)) for item in prompt]

    async def _submit(
        self, base_id: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams
    ) -> list[Submission]:
        """Queue every prompt in an engine before any response starts: refusals stay plain HTTP errors."""
        submissions: list[Submission] = []
        try:
            for prompt_index, (prompt, token_ids) in enumerate(prompts):
                request_id = base_id if len(prompts) == 1 else f"{base_id}-{prompt_index}"
                client = self.router.pick(token_ids)
                state = self.processor.add_request(request_id, prompt, token_ids, params)
                submissions.append(Submission(request_id, prompt_index, client, state))
                await client.submit(request_id, token_ids, params)
        except BaseException as error:
            self._release(submissions)
            if isinstance(error, ValueError):
                raise RequestError(400, str(error)) from error
            raise
        return submissions

    def _release(self, submissions: list[Submission]) -> None:
        """Forget the submissions and abort those still in the engine; a no-op for the ones that finished."""
        for submission in submissions:
            self.processor.requests.pop(submission.request_id, None)
            submission.client.cancel(submission.request_id)

    async def _follow(self, submission: Submission, params: SamplingParams) -> AsyncIterator[RequestState]:
        """Yields the request's state each time it changes, until every completion finished."""
        state, client = submission.state, submission.client
        try:
            async with contextlib.aclosing(client.outputs(submission.request_id, params.n)) as stream:
                async for outputs in stream:
                    processed = self.processor.process(outputs)
                    for stopped_id, index, stop_string in processed.stop_strings:
                        await client.stop_completion(stopped_id, index, stop_string)
                    if processed.changed:
                        yield state
                    if state.output.finished:
                        return
        finally:
            self.processor.requests.pop(submission.request_id, None)

    async def _merged(
        self, submissions: list[Submission], params: SamplingParams
    ) -> AsyncIterator[tuple[int, RequestState]]:
        """Follow every prompt at once; yield (prompt index, state) as they progress."""
        if len(submissions) == 1:
            async with contextlib.aclosing(self._follow(submissions[0], params)) as stream:
                async for state in stream:
                    yield 0, state
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def run(submission: Submission) -> None:
            try:
                async with contextlib.aclosing(self._follow(submission, params)) as stream:
                    async for state in stream:
                        queue.put_nowait((submission.prompt_index, state))
            except BaseException as error:
                queue.put_nowait(error)
                raise
            finally:
                queue.put_nowait(done)

        tasks = [asyncio.create_task(run(submission)) for submission in submissions]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_to_end(self, submissions: list[Submission], params: SamplingParams) -> dict[int, RequestState]:
        """Every prompt's final state (non-streamed responses), within the configured time limit."""
        final: dict[int, RequestState] = {}
        try:
            async with self._deadline():
                async for prompt_index, state in self._merged(submissions, params):
                    final[prompt_index] = state
        except TimeoutError as error:
            raise self._timeout_error() from error
        finally:
            # Also when cancelled (client gone) before a follower started: nothing may stay queued unread.
            self._release(submissions)
        return final

    def _timeout_error(self) -> RequestError:
        limit = self.config.serve.request_timeout_s
        return RequestError(504, f"the request did not finish within {limit} s and was aborted.", "TimeoutError")

    def _deadline(self) -> asyncio.Timeout:
        """The configured end-to-end limit (none by default)."""
        return asyncio.timeout(self.config.serve.request_timeout_s)

    def _validate_prompts(self, prompts: list[tuple[str | None, list[int]]], params: SamplingParams) -> None:
        """The engine's own checks, here, so a bad request is a 400 before anything reaches the scheduler."""
        for _, token_ids in prompts:
            try:
                validate_prompt(token_ids, params, self.engine_info["max_model_len"], self.engine_info["vocab_size"])
            except ValueError as error:
                raise RequestError(400, str(error), param=parameter_named_in(str(error)) or "prompt") from error

    async def completions(self, request: Request) -> Response:
        return await self.complete(await parse_body(request, CompletionRequest, self.guard))

    async def complete(self, body: CompletionRequest) -> Response:
        self._check_model(body.model)
        if body.echo and body.logprobs is not None:
            raise RequestError(400, "echo together with logprobs is not supported.", param="echo")
        params = self._sampling_params(body, body.max_tokens, body.logprobs)
        prompts = await self._completion_prompts(body.prompt)
        self._validate_prompts(prompts, params)
        completion_id = random_id("cmpl")
        created = now()
        submissions = await self._submit(completion_id, prompts, params)
        if body.stream:
            return self._stream(
                self._completion_chunks(completion_id, created, prompts, submissions, params, body), submissions
            )
        final = await self._run_to_end(submissions, params)
        choices = []
        num_completion_tokens = 0
        for prompt_index in range(len(prompts)):
            output = final[prompt_index].output
            for completion in output.outputs:
                num_completion_tokens += len(completion.token_ids)
                prefix = self._echo_text(prompts[prompt_index]) if body.echo else ""
                choices.append(
                    {
                        "index": prompt_index * params.n + completion.index,
                        "text": prefix + completion.text,
                        "logprobs": None
                        if completion.logprobs is None
                        else self.logprobs.completion(completion.logprobs),
                        "finish_reason": completion.finish_reason,
                        "stop_reason": completion.stop_reason,
                    }
                )
        num_prompt_tokens = sum(len(token_ids) for _, token_ids in prompts)
        return JSONResponse(
            {
                "id": completion_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": choices,
                "usage": usage(num_prompt_tokens, num_completion_tokens),
            }
        )

    def _echo_text(self, prompt: tuple[str | None, list[int]]) -> str:
        text, token_ids = prompt
        return text if text is not None else self.tokenizer.decode(token_ids)

    async def _completion_chunks(
        self,
        completion_id: str,
        created: int,
        prompts: list,
        submissions: list[Submission],
        params: SamplingParams,
        body: CompletionRequest,
    ) -> AsyncIterator[dict[str, Any]]:
        def chunk(index: int, text: str, logprobs: Any = None, finish_reason: Any = None, stop_reason: Any = None):
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
            return {
                "id": completion_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [choice],
            }

        if body.echo:
            for prompt_index, prompt in enumerate(prompts):
                for index in range(params.n):
                    yield chunk(prompt_index * params.n + index, self._echo_text(prompt))
        num_completion_tokens = 0
        text_offsets: dict[int, int] = {}
        async for prompt_index, state in self._merged(submissions, params):
            for delta in state.deltas:
                num_completion_tokens += len(delta.token_ids)
                if not delta.text and delta.finish_reason is None:
                    continue
                index = prompt_index * params.n + delta.index
                logprobs = None
                if params.logprobs is not None:
                    logprobs = self.logprobs.completion(delta.logprobs, text_offsets.get(index, 0))
                    text_offsets[index] = text_offsets.get(index, 0) + len(delta.text)
                yield chunk(index, delta.text, logprobs, delta.finish_reason, delta.stop_reason)
        if body.stream_options and body.stream_options.include_usage:
            num_prompt_tokens = sum(len(token_ids) for _, token_ids in prompts)
            yield {
                "id": completion_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [],
                "usage": usage(num_prompt_tokens, num_completion_tokens),
            }

    def _render_chat(self, messages: list[Any], add_generation_prompt: bool, continue_final_message: bool) -> list[int]:
        """The prompt's token ids. Special-token text inside a message (`<|im_end|>` ...) is the sender's text, not a
        control token: each occurrence is swapped for a placeholder before rendering and tokenized as plain text."""
        if not messages:
            raise RequestError(400, "messages must not be empty.", param="messages")
        literals: dict[str, str] = {}
        nonce = secrets.token_hex(8)

        def hide_special_text(text: str) -> str:
            def placeholder(match: re.Match) -> str:
                key = f"\ue000{nonce}:{len(literals)}\ue001"
                literals[key] = match.group(0)
                return key

            return text if self.special_token_text is None else self.special_token_text.sub(placeholder, text)

        try:
            contents = [message_text(message) for message in messages]
            self._check_prompt_chars(sum(map(len, contents)), "messages")
            conversation = [
                {"role": message.role, "content": hide_special_text(content)}
                for message, content in zip(messages, contents)
            ]
            text = self.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
            )
        except ValueError as error:
            raise RequestError(400, str(error), param="messages") from error
        # The template's own text holds the special tokens the model expects: those parse as control tokens.
        if not literals:
            return self.tokenizer.encode(text, add_special_tokens=False)
        token_ids: list[int] = []
        for piece in re.split(f"(\ue000{nonce}:\\d+\ue001)", text):
            if piece in literals:
                token_ids += self._plain_text_token_ids(literals[piece])
            elif piece:
                token_ids += self.tokenizer.encode(piece, add_special_tokens=False)
        return token_ids

    def _plain_text_token_ids(self, text: str) -> list[int]:
        """Token ids of `text` with every special-token string in it spelled out as ordinary text."""
        token_ids: list[int] = []
        while text:
            match = self.special_token_text.search(text)
            if match is None:
                return token_ids + self.tokenizer.encode(text, add_special_tokens=False)
            # Cut after the marker's first character: what is left no longer matches it.
            token_ids += self.tokenizer.encode(text[: match.start() + 1], add_special_tokens=False)
            text = text[match.start() + 1 :]
        return token_ids

    async def chat_completions(self, request: Request) -> Response:
        return await self.chat(await parse_body(request, ChatCompletionRequest, self.guard))

    async def chat(self, body: ChatCompletionRequest) -> Response:
        self._check_model(body.model)
        self._refuse_request_templates(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs")
        prompt_token_ids = await self._tokenizing(
            self._render_chat, body.messages, body.add_generation_prompt, body.continue_final_message
        )
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._sampling_params(body, max_tokens, logprobs)
        prompts = [(None, prompt_token_ids)]
        self._validate_prompts(prompts, params)
        completion_id = random_id("chatcmpl")
        created = now()
        submissions = await self._submit(completion_id, prompts, params)
        if body.stream:
            return self._stream(
                self._chat_chunks(completion_id, created, prompts, submissions, params, body), submissions
            )
        state = (await self._run_to_end(submissions, params))[0]
        choices = [
            {
                "index": completion.index,
                "message": {"role": "assistant", "content": completion.text},
                "logprobs": None if completion.logprobs is None else self.logprobs.chat(completion.logprobs),
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
            for completion in state.output.outputs
        ]
        num_completion_tokens = sum(len(completion.token_ids) for completion in state.output.outputs)
        return JSONResponse(
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": created,
                "model": self.model_name,
                "choices": choices,
                "usage": usage(len(prompt_token_ids), num_completion_tokens),
            }
        )

    async def _chat_chunks(
        self,
        completion_id: str,
        created: int,
        prompts: list,
        submissions: list[Submission],
        params: SamplingParams,
        body: ChatCompletionRequest,
    ) -> AsyncIterator[dict[str, Any]]:
        def chunk(index: int, delta: dict[str, Any], finish_reason: Any = None, logprobs: Any = None):
            return {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
            }

        for index in range(params.n):
            yield chunk(index, {"role": "assistant", "content": ""})
        num_completion_tokens = 0
        async for _, state in self._merged(submissions, params):
            for delta in state.deltas:
                num_completion_tokens += len(delta.token_ids)
                logprobs = self.logprobs.chat(delta.logprobs) if params.logprobs is not None else None
                if delta.text or logprobs:
                    yield chunk(delta.index, {"content": delta.text}, logprobs=logprobs)
                if delta.finish_reason is not None:
                    yield chunk(delta.index, {}, delta.finish_reason)
        if body.stream_options and body.stream_options.include_usage:
            yield {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": [],
                "usage": usage(len(prompts[0][1]), num_completion_tokens),
            }

    def _stream(self, chunks: AsyncIterator[dict[str, Any]], submissions: list[Submission]) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            try:
                async with self._deadline(), contextlib.aclosing(chunks) as stream:
                    async for payload in stream:
                        yield sse(payload)
            except TimeoutError:
                error = self._timeout_error()
                yield sse(error_body(error.message, error.error_type, error.status))
            except RequestError as error:
                yield sse(error_body(error.message, error.error_type, error.status, error.param))
            except EngineDeadError as error:
                yield sse(error_body(f"the engine is unavailable: {error}", "ServiceUnavailableError", 503))
            yield sse("[DONE]")

        return ReleasingStreamingResponse(events(), functools.partial(self._release, submissions))


def build_app(config: AppConfig | dict[str, Any] | str | Path | None = None) -> serve.Application:
    """The bound Serve application. `config` is an AppConfig, its dict form, or a YAML path.

    As a Serve application builder, `args` may also be `{"config": "configs/default.yaml"}`.
    """
    if config is None:
        config = AppConfig()
    elif isinstance(config, str | Path):
        config = AppConfig.from_yaml(config)
    elif isinstance(config, dict):
        config = (
            AppConfig.from_yaml(config["config"]) if set(config) == {"config"} else AppConfig.model_validate(config)
        )
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
