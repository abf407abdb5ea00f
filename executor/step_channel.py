"""A direct TCP connection from the scheduler actor to one model worker, carrying each step's plan and result.

A Ray actor call per step costs both processes more CPU than the step's data (task submission, gRPC threads,
the reply's callback into the event loop); on a small machine those cores are the ones the model's threads use.
So once a worker is up, its steps go over a socket of its own, as vLLM's engine core talks to its workers over
message queues: one pickle and one send each way. Ray still places, starts, health-checks and kills the workers.

Frames: 8 bytes of little-endian length, then a pickle. The worker replies to each plan in order, with
(True, StepResult) or (False, the error's traceback). The connection opens with a secret the worker handed over
through Ray, so nothing else on the network can drive the model.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hmac
import logging
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

HEADER_BYTES = 8
ACCEPT_TIMEOUT_S = 60.0
SECRET_BYTES = 16
SECRET_TIMEOUT_S = 5.0  # for a connection to present the secret


class StepChannelClosedError(ConnectionError):
    """The worker's end of the channel is gone (its process died, or it failed a step and the engine moved on)."""


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(HEADER_BYTES, "little") + payload


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """The next frame's payload from an asyncio stream (raises IncompleteReadError once the peer has closed)."""
    header = await reader.readexactly(HEADER_BYTES)
    return await reader.readexactly(int.from_bytes(header, "little"))


async def open_framed_connection(
    host: str, port: int, hello: bytes
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect (no Nagle delay: every frame is a whole message someone waits for) and send `hello` as the first
    frame (the secret, and whatever else the listener expects with it)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    writer.write(frame(hello))
    return reader, writer


def _receive_exactly(connection: socket.socket, num_bytes: int) -> bytes | None:
    """`num_bytes` bytes, or None once the peer has closed the connection."""
    chunks, remaining = [], num_bytes
    while remaining:
        chunk = connection.recv(min(remaining, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _receive_frame(connection: socket.socket) -> bytes | None:
    header = _receive_exactly(connection, HEADER_BYTES)
    if header is None:
        return None
    return _receive_exactly(connection, int.from_bytes(header, "little"))


def _accept_with_secret(listener: socket.socket, secret: bytes) -> socket.socket | None:
    """The first connection that presents the secret (others are closed), or None after ACCEPT_TIMEOUT_S."""
    deadline = time.monotonic() + ACCEPT_TIMEOUT_S
    with listener:
        while (remaining := deadline - time.monotonic()) > 0:
            listener.settimeout(remaining)
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                break
            connection.settimeout(min(remaining, SECRET_TIMEOUT_S))
            try:
                offered = _receive_exactly(connection, HEADER_BYTES + SECRET_BYTES)
            except OSError:
                offered = None
            if offered is not None and hmac.compare_digest(offered, frame(secret)):
                connection.settimeout(None)
                return connection
            logger.warning("step channel refused a connection without the secret")
            connection.close()
    logger.warning("no scheduler actor connected to the step channel within %.0fs", ACCEPT_TIMEOUT_S)
    return None


def serve_steps(listener: socket.socket, secret: bytes, execute: Callable[[Any], Any]) -> None:
    """Worker side, on the worker's compute thread: accept the scheduler actor's connection, then run each plan it
    sends and reply with the result, until it hangs up."""
    connection = _accept_with_secret(listener, secret)
    if connection is None:
        return
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with connection:
        while (payload := _receive_frame(connection)) is not None:
            try:
                reply = (True, execute(pickle.loads(payload)))
            except Exception:
                logger.exception("model step failed")
                reply = (False, traceback.format_exc())
            connection.sendall(frame(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)))


def open_step_listener(
    host: str, execute: Callable[[Any], Any], start: Callable[[Callable[[], None]], None]
) -> tuple[str, int, bytes]:
    """Worker side: listen on `host` and have `start` run the step server (on the thread that runs the model);
    returns (host, port, secret)."""
    secret = os.urandom(SECRET_BYTES)
    listener = socket.create_server((host, 0))
    port = listener.getsockname()[1]
    start(functools.partial(serve_steps, listener, secret, execute))
    return host, port, secret


def fail(future: asyncio.Future, error: BaseException) -> None:
    """Fail a reply future. Marked retrieved: a step abandoned after another rank failed is awaited by nobody,
    and the failure that matters is the one its awaiter reports."""
    future.set_exception(error)
    future.exception()


class StepChannel:
    """Scheduler actor side: send plans, await their results in order. Lives on one event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str):
        self.reader = reader
        self.writer = writer
        self.name = name
        self.loop = asyncio.get_running_loop()
        self.pending: collections.deque[asyncio.Future] = collections.deque()
        self.closed_reason: str | None = None
        self.reader_task = self.loop.create_task(self._read_replies())

    @classmethod
    async def connect(cls, host: str, port: int, secret: bytes, name: str) -> StepChannel:
        return cls(*await open_framed_connection(host, port, secret), name)

    def send(self, payload: bytes) -> asyncio.Future:
        """Queue a pickled plan behind any still running; the future resolves to the worker's reply."""
        future = self.loop.create_future()
        if self.closed_reason is not None:
            future.set_exception(StepChannelClosedError(self.closed_reason))
            return future
        self.writer.write(frame(payload))
        self.pending.append(future)
        return future

    async def _read_replies(self) -> None:
        try:
            while True:
                ok, value = pickle.loads(await read_frame(self.reader))
                future = self.pending.popleft()
                if future.done():
                    continue  # its step was abandoned
                if ok:
                    future.set_result(value)
                else:
                    fail(future, RuntimeError(f"{self.name} failed a step:\n{value}"))
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as error:
            self._close(f"{self.name}'s step channel closed ({type(error).__name__}): the worker is gone")
        except asyncio.CancelledError:
            self._close(f"{self.name}'s step channel was closed")
            raise

    def _close(self, reason: str) -> None:
        self.closed_reason = reason
        while self.pending:
            future = self.pending.popleft()
            if not future.done():
                fail(future, StepChannelClosedError(reason))
        self.writer.close()

    def close(self) -> None:
        """From any thread: stop reading and hang up (the worker's step thread then ends)."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.reader_task.cancel)
