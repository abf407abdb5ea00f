"""The benchmark's HTTP client: one streamed OpenAI request at a time, measured into a `RequestRecord`.

Speaks both `/completions` and `/chat/completions` server-sent event streams, to any OpenAI-compatible server.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from cluster.bench.config import BenchConfig

T = TypeVar("T")


@dataclass
class RequestRecord:
    """What one request measured. Times are seconds; `start_s` is relative to the benchmark start."""

    success: bool = False
    start_s: float = 0.0
    latency_s: float = 0.0  # end-to-end: request sent -> stream finished
    ttft_s: float | None = None  # request sent -> first non-empty text chunk
    itl_s: list[float] = field(default_factory=list)  # gaps between successive non-empty text chunks
    output_tokens: int = 0  # usage.completion_tokens when the server sends it, else the number of text chunks
    prompt_tokens: int | None = None  # usage.prompt_tokens; None when the server sends no usage
    usage_reported: bool = False
    generated_text: str = ""
    error: str = ""


def request_body(config: BenchConfig, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "temperature": config.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = max_tokens
    else:
        body["prompt"] = prompt
        body["max_tokens"] = max_tokens
    return body


def endpoint_url(config: BenchConfig) -> str:
    path = "chat/completions" if config.endpoint == "chat" else "completions"
    return f"{config.base_url.rstrip('/')}/{path}"


def chunk_text(chunk: dict[str, Any]) -> str:
    """The generated text a streamed chunk carries, for completions and chat chunks alike."""
    text = ""
    for choice in chunk.get("choices") or []:
        if "text" in choice:
            text += choice.get("text") or ""
        delta = choice.get("delta") or {}
        # Reasoning servers stream thinking as reasoning_content; it is generated output all the same.
        text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return text


async def sse_payloads(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The payload of every `data:` line of a server-sent event stream, stopping at `data: [DONE]`."""
    async for line in response.content:
        if not line.startswith(b"data:"):
            continue  # blank separators, `:` keep-alive comments, event/id fields
        payload = line[len(b"data:") :].strip()
        if payload == b"[DONE]":
            return
        if payload:
            yield payload


def run_client(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a benchmark client on uvloop where it is installed (it comes with Ray Serve's uvicorn): the client
    shares the machine with the server under test, and uvloop's event loop takes less of its CPU."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def client_session(max_connections: int | None, headers: dict[str, str] | None = None) -> aiohttp.ClientSession:
    """An aiohttp session (as `vllm bench serve` uses: it costs the shared machine less CPU than httpx) with a
    pooled connection for every in-flight request, since waiting on the pool would count as TTFT. Each request
    keeps its own deadline, so the session has none."""
    return aiohttp.ClientSession(
        headers=headers,
        connector=aiohttp.TCPConnector(limit=max_connections or 0),
        timeout=aiohttp.ClientTimeout(total=None),
        read_bufsize=2**20,  # SSE lines longer than aiohttp's 64 KiB default (big chunks with logprobs)
    )


async def send_request(
    session: aiohttp.ClientSession, config: BenchConfig, model: str, prompt: str, max_tokens: int, origin: float
) -> RequestRecord:
    """One streaming request; never raises for request failures, they land in the record."""
    record = RequestRecord()
    started = time.perf_counter()
    record.start_s = started - origin
    chunks_with_text = 0
    try:
        async with asyncio.timeout(config.timeout):
            async with session.post(
                endpoint_url(config), json=request_body(config, model, prompt, max_tokens)
            ) as response:
                if response.status != 200:
                    body = (await response.read()).decode(errors="replace")
                    record.error = f"HTTP {response.status}: {body[:500]}"
                else:
                    last = started
                    text_parts: list[str] = []
                    async for payload in sse_payloads(response):
                        chunk = json.loads(payload)
                        if "error" in chunk:
                            record.error = f"error chunk: {json.dumps(chunk['error'])[:500]}"
                            break
                        if chunk.get("usage"):
                            record.prompt_tokens = chunk["usage"].get("prompt_tokens")
                            record.output_tokens = chunk["usage"].get("completion_tokens") or 0
                            record.usage_reported = True
                        text = chunk_text(chunk)
                        if not text:
                            continue
                        now = time.perf_counter()
                        if record.ttft_s is None:
                            record.ttft_s = now - started
                        else:
                            record.itl_s.append(now - last)
                        last = now
                        chunks_with_text += 1
                        text_parts.append(text)
                    record.generated_text = "".join(text_parts)
                    if not record.error and record.ttft_s is None:
                        record.error = "the stream ended without any generated text"
    except TimeoutError:
        record.error = f"timed out after {config.timeout} s"
    except Exception as error:
        # Any failure (connection, protocol, a malformed chunk) is one failed request: the run goes on.
        record.error = f"{type(error).__name__}: {error}"
    record.latency_s = time.perf_counter() - started
    if not record.usage_reported:
        record.output_tokens = chunks_with_text
    record.success = not record.error
    return record


async def first_model_id(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model id `GET {base_url}/models` lists; RuntimeError when it lists none."""
    async with session.get(f"{base_url.rstrip('/')}/models", timeout=aiohttp.ClientTimeout(total=60)) as response:
        response.raise_for_status()
        models = (await response.json()).get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/models lists no model; pass --model")
    return models[0]["id"]
