"""Each step's outputs from the scheduler actor to one ingress replica, over a TCP connection of their own.

The socket counterpart of `EngineActor.stream_outputs` (a Ray streaming generator: an object, a report RPC and
its reply per batch in both processes, on the two cores the model's threads use). The ingress asks the scheduler
actor where to connect (a Ray call, once per engine), opens the connection with the engine's secret and its client
id, then reads frames (see executor.step_channel): (True, a batch of outputs) per step, an empty batch at least
every OUTPUT_POLL_TIMEOUT_S while nothing is produced, or (False, the error) once, after which the scheduler actor
hangs up (the client's requests failed or the engine is down) and the next read connects again.
"""

from __future__ import annotations

import asyncio
import hmac
import pickle
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from executor.step_channel import (
    HEADER_BYTES,
    SECRET_BYTES,
    SECRET_TIMEOUT_S,
    frame,
    open_framed_connection,
    read_frame,
)

MAX_CLIENT_ID_BYTES = 256


class OutputChannelClosedError(ConnectionError):
    """The scheduler actor's end closed without an error frame (it died, or a newer connection replaced this)."""


async def accept_client(reader: asyncio.StreamReader, secret: bytes) -> str | None:
    """Scheduler actor side: the client id a new connection presents with the secret, or None (then hang up)."""
    try:
        header = await asyncio.wait_for(reader.readexactly(HEADER_BYTES), SECRET_TIMEOUT_S)
        size = int.from_bytes(header, "little")
        if not SECRET_BYTES < size <= SECRET_BYTES + MAX_CLIENT_ID_BYTES:
            return None
        hello = await asyncio.wait_for(reader.readexactly(size), SECRET_TIMEOUT_S)
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
        return None
    if not hmac.compare_digest(hello[:SECRET_BYTES], secret):
        return None
    return hello[SECRET_BYTES:].decode(errors="replace")


async def send_outputs(
    writer: asyncio.StreamWriter,
    wait_for_outputs: Callable[[], Awaitable[None]],
    take_outputs: Callable[[], list],
    superseded: Callable[[], bool],
) -> bool:
    """Scheduler actor side: after each wait (for outputs, or the poll interval; it raises the client's failure) a
    batch of what was taken, until the client hangs up, a failure was sent, or a newer connection of the client
    takes over. While the ingress reads slowly, `drain` holds this loop and later steps pile up into one batch.
    Returns True when the client hung up (its process is gone), False otherwise."""
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while True:
            try:
                await wait_for_outputs()
                if superseded():
                    return False  # what came is the newer connection's
                reply = (True, take_outputs())
            except Exception as error:
                reply = (False, error)
            # uvloop raises RuntimeError, not ConnectionError, on a write to a transport the peer's reset closed.
            if writer.is_closing():
                return True
            writer.write(frame(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)))
            await writer.drain()
            if not reply[0]:
                return False
    except (ConnectionError, OSError):
        return True
    finally:
        writer.close()


class OutputChannel:
    """Ingress side: one connection to one scheduler actor."""

    def __init__(self, engine: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.engine = engine
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, engine: Any, client_id: str) -> OutputChannel:
        host, port, secret = await engine.open_output_channel.remote()
        return cls(engine, *await open_framed_connection(host, port, secret + client_id.encode()))

    async def next_batch(self) -> list:
        """The next batch; raises the client's failure as the engine sent it, or OutputChannelClosedError."""
        try:
            ok, value = pickle.loads(await read_frame(self.reader))
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as error:
            self.close()
            raise OutputChannelClosedError(f"the scheduler actor's output connection closed: {error!r}") from error
        if not ok:
            self.close()
            raise value
        return value

    def close(self) -> None:
        self.writer.close()
