"""Each step's outputs from the step loop to the ingress replica that owns each request.

Outputs wait in a queue per client until its reader takes them, a batch at a time: over a Ray streaming generator
(`EngineActor.stream_outputs`), the socket output channel (executor.output_channel), or plain `get_outputs` polls.
A reader that lags gets everything since its last batch in one; a failure the engine met reaches each client once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Container, Iterable, Sequence

from executor.client_registry import ClientRegistry
from executor.engine_core import EngineOutput
from executor.errors import EngineDeadError
from executor.output_channel import accept_client, send_outputs
from executor.step_channel import SECRET_BYTES

logger = logging.getLogger(__name__)

OUTPUT_POLL_TIMEOUT_S = 2.0


class StreamIntervalBuffer:
    """Holds each completion's new tokens until `interval` of them are due; its first token and its finishing
    output go out at once. With an interval of 1 every output passes straight through."""

    def __init__(self, interval: int):
        self.interval = interval
        self.held: dict[tuple[str, int], EngineOutput] = {}
        self.started: set[tuple[str, int]] = set()

    def __len__(self) -> int:
        return len(self.held) + len(self.started)

    def push(self, output: EngineOutput) -> EngineOutput | None:
        """The output to hand on now (the held tokens merged in front), or None while it is held."""
        if self.interval == 1:
            return output
        key = (output.request_id, output.index)
        held = self.held.pop(key, None)
        if held is not None:
            held.extend(output)
            output = held
        if output.finish_reason is not None:
            self.started.discard(key)
            return output
        if key not in self.started:
            self.started.add(key)  # the first token is never held: time to first token stays as it is
            return output
        if len(output.new_token_ids) >= self.interval:
            return output
        self.held[key] = output if held is not None else output.copy()
        return None

    def drop(self, request_id: str, index: int) -> None:
        """Forget a completion ended downstream (a stop string): what it held is past its end."""
        self.held.pop((request_id, index), None)
        self.started.discard((request_id, index))

    def retain(self, live_request_ids: Container[str]) -> None:
        """Forget every request that is no longer in flight (finished, aborted, failed)."""
        self.held = {key: output for key, output in self.held.items() if key[0] in live_request_ids}
        self.started = {key for key in self.started if key[0] in live_request_ids}


class OutputRouter:
    """Per-client output queues, filled by the step loop and emptied by each client's one reader.

    `engine_ready` starts the engine (and its step loop) for a reader; `raise_if_dead` raises EngineDeadError while
    the engine is down; `hung_up(client_id)` hears of a client whose output connection its peer closed. Reads renew
    the reader's lease in `clients`.
    """

    def __init__(
        self,
        clients: ClientRegistry,
        stream_interval: int,
        engine_ready: Callable[[], Awaitable[None]],
        raise_if_dead: Callable[[], None],
        hung_up: Callable[[str], None],
    ):
        self.clients = clients
        self.engine_ready = engine_ready
        self.raise_if_dead = raise_if_dead
        self.hung_up = hung_up
        self.stream_buffer = StreamIntervalBuffer(stream_interval)
        self.client_outputs: dict[str, list[EngineOutput]] = defaultdict(list)
        self.client_events: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        # Cleared by the client's next request (a rebuild failed its earlier ones), unlike the registry's
        # lease failures, which only its next read may clear.
        self.client_failures: dict[str, str] = {}
        # The one live reader (stream or connection) of each client: a newer one supersedes it.
        self.client_readers: dict[str, object] = {}
        self.output_secret = os.urandom(SECRET_BYTES)

    @property
    def num_held(self) -> int:
        """Completions the stream interval buffer tracks."""
        return len(self.stream_buffer)

    @property
    def num_undelivered(self) -> int:
        return sum(map(len, self.client_outputs.values()))

    def deliver(self, outputs: Sequence[EngineOutput]) -> set[str]:
        """Queue a step's outputs for their clients (an output of no client's request is dropped); returns the
        requests with a completion that finished."""
        request_owner = self.clients.request_owner
        finished_request_ids = set()
        for output in outputs:
            client_id = request_owner.get(output.request_id)
            if client_id is None:
                continue
            output = self.stream_buffer.push(output)
            if output is None:
                continue
            self.client_outputs[client_id].append(output)
            self.client_events[client_id].set()
            if output.finish_reason is not None:
                finished_request_ids.add(output.request_id)
        return finished_request_ids

    def drop_completion(self, request_id: str, index: int) -> None:
        self.stream_buffer.drop(request_id, index)

    def drop_ended_requests(self) -> None:
        """Forget what is held for requests no client owns any more."""
        self.stream_buffer.retain(self.clients.request_owner)

    def forget_client(self, client_id: str) -> None:
        """Drop what a forgotten client had (its requests are already released)."""
        self.drop_ended_requests()
        for table in (self.client_outputs, self.client_events, self.client_failures):
            table.pop(client_id, None)

    def clear_failure(self, client_id: str) -> None:
        """The client's new request runs: its requests from before a rebuild were already failed."""
        self.client_failures.pop(client_id, None)

    def fail(self, client_ids: Iterable[str], reason: str) -> None:
        """Each client gets one EngineDeadError(reason) from its next read, instead of its undelivered outputs."""
        for client_id in client_ids:
            self.client_failures[client_id] = reason
            self.client_outputs.pop(client_id, None)
        self.drop_ended_requests()
        for event in self.client_events.values():
            event.set()

    def in_flight(self, client_id: str) -> bool:
        """Requests of this client still running, or a failure it has not been told of yet."""
        failed = client_id in self.client_failures or self.clients.has_lease_failure(client_id)
        return failed or self.clients.has_requests(client_id)

    async def wait(self, client_id: str) -> None:
        """The client is alive (lease renewed); raises its pending failure, else waits up to OUTPUT_POLL_TIMEOUT_S
        for outputs."""
        self.clients.touch(client_id)
        failure = self.client_failures.pop(client_id, None)
        if failure is None:
            failure = self.clients.take_lease_failure(client_id)
        if failure is not None:
            raise EngineDeadError(failure)
        # A client with nothing in flight is not told of an outage: the failure would wait unread in its channel
        # and reach its first request after the engine recovered.
        idle = not self.clients.has_requests(client_id)
        if not idle:
            await self.engine_ready()
        if not self.client_outputs.get(client_id):
            if not idle:
                self.raise_if_dead()
            # asyncio.timeout, not wait_for: this runs once per step per client, and wait_for wraps it in a task.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(OUTPUT_POLL_TIMEOUT_S):
                    await self.client_events[client_id].wait()

    def take(self, client_id: str) -> list[EngineOutput]:
        """Everything queued for the client; raises EngineDeadError if there is nothing and the engine is down."""
        self.client_events[client_id].clear()
        outputs = self.client_outputs.pop(client_id, [])
        if not outputs and self.clients.has_requests(client_id):
            self.raise_if_dead()
        return outputs

    async def stream(self, client_id: str) -> AsyncIterator[list[EngineOutput]]:
        """A batch after each wait, until the client has nothing in flight and nothing undelivered, or a newer
        reader of the same client started."""
        reader = object()
        self.client_readers[client_id] = reader
        try:
            while self.client_outputs.get(client_id) or self.in_flight(client_id):
                await self.wait(client_id)
                if self.client_readers.get(client_id) is not reader:
                    return  # superseded: what came is the newer reader's
                yield self.take(client_id)
        finally:
            if self.client_readers.get(client_id) is reader:
                del self.client_readers[client_id]

    async def start_output_server(self) -> asyncio.Server:
        """Listen for output channel connections (executor.output_channel) on this node."""
        import ray

        return await asyncio.start_server(self._serve_connection, ray.util.get_node_ip_address(), 0)

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client_id = await accept_client(reader, self.output_secret)
        if client_id is None:
            logger.warning("output channel refused a connection without the secret")
            writer.close()
            return
        connection = object()
        self.client_readers[client_id] = connection
        hung_up = False
        try:
            hung_up = await send_outputs(
                writer,
                lambda: self.wait(client_id),
                lambda: self.take(client_id),
                lambda: self.client_readers.get(client_id) is not connection,
            )
        finally:
            current = self.client_readers.get(client_id) is connection
            if current:
                del self.client_readers[client_id]
        if hung_up and current:
            self.hung_up(client_id)
