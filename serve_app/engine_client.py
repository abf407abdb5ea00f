"""The ingress side of the scheduler actor: one output pump per ingress replica, one queue per request.

Aborts go out in batches (a storm of disconnects is a few Ray calls, not hundreds), and a scheduler actor that is
gone is replaced: the client creates (or adopts, by name) a new one and serves again once it is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import ray

from configs.sampling_params import SamplingParams
from executor.engine_actor import OUTPUT_POLL_TIMEOUT_S, background_task, open_output_stream
from executor.engine_core import EngineOutput
from executor.errors import EngineDeadError, EngineDrainingError, EngineOverloadedError, short_reason
from executor.output_channel import OutputChannel, OutputChannelClosedError
from serve_app.engines import ENGINE_READY_TIMEOUT_S

logger = logging.getLogger(__name__)

# A request whose outputs nobody started reading this long after it was queued has lost its reader. A reader that
# is there but slow (a slow client, a saturated proxy) is never reaped, however long it stalls.
ORPHAN_QUEUE_S = 120.0
RESTART_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)
# A replica that refused a request as down gets no new ones for this long while another replica is up.
UNAVAILABLE_BACKOFF_S = 2.0


def unwrap_ray_error(error: BaseException) -> BaseException:
    """A ValueError raised in the actor arrives wrapped; hand the original to the HTTP layer."""
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = error.as_instanceof_cause()
        if isinstance(cause, ValueError | EngineDeadError | EngineOverloadedError | EngineDrainingError):
            # The actor's own exception: its message without Ray's remote traceback.
            return error.cause
        return EngineDeadError(short_reason(error))
    if isinstance(error, ray.exceptions.RayActorError):
        return EngineDeadError(f"the scheduler actor died: {short_reason(error)}")
    return error


def merge_outputs(batches: Iterable[list[EngineOutput]]) -> list[EngineOutput]:
    """Steps that piled up for one request (its reader fell behind) as one output per completion, in order.

    A reader that keeps up sees one step at a time; one that lags (a saturated ingress, a slow client) gets one
    larger delta per completion instead of one SSE event per step, so falling behind gets cheaper, not worse.
    """
    merged: dict[int, EngineOutput] = {}
    for batch in batches:
        for output in batch:
            earlier = merged.get(output.index)
            if earlier is None:
                merged[output.index] = output.copy()
            else:
                earlier.extend(output)
    return list(merged.values())


class EngineClient:
    """One engine replica as one ingress replica sees it.

    `create_engine` (blocking, called off the event loop) returns a handle to a scheduler actor by name, creating it
    if it does not exist; it is called again when the actor is found dead.
    """

    def __init__(
        self,
        engine: Any,
        create_engine: Callable[[], Any] | None = None,
        transport: str = "socket",
        replica_index: int = 0,
    ):
        """`transport`: the engine's (EngineConfig.transport): outputs over a socket, or a Ray streaming generator.
        `replica_index`: the engine replica's index in its group (what prefix routing hashes to)."""
        self.engine = engine
        self.replica_index = replica_index
        # Until when routing passes this replica by (it refused a request as down), where another can take it.
        self.unavailable_until = 0.0
        self.create_engine = create_engine
        self.transport = transport
        self.output_channel: OutputChannel | None = None
        self.client_id = uuid.uuid4().hex
        self.queues: dict[str, asyncio.Queue] = {}
        self.queued_at: dict[str, float] = {}
        self.reading: set[str] = set()
        self.pump_task: asyncio.Task | None = None
        self.engine_error: BaseException | None = None
        self.pending_aborts: set[str] = set()
        self.pending_admissions: list[tuple[str, list[int], SamplingParams, asyncio.Future]] = []
        self.admit_task: asyncio.Task | None = None
        self.submitted = asyncio.Event()
        self.abort_task: asyncio.Task | None = None
        self.restart_task: asyncio.Task | None = None
        self.restart_error: str | None = None
        self.num_restarts = 0

    @property
    def num_in_flight(self) -> int:
        return len(self.queues)

    @property
    def restarting(self) -> bool:
        return self.restart_task is not None and not self.restart_task.done()

    def _raise_if_restarting(self) -> None:
        if self.restarting:
            reason = f" (last attempt: {self.restart_error})" if self.restart_error else ""
            raise EngineDeadError(f"the engine is restarting after a failure{reason}")

    def on_engine_error(self, error: BaseException) -> None:
        """Any call that found the scheduler actor gone starts its replacement (once)."""
        if isinstance(error, ray.exceptions.RayActorError) and self.create_engine is not None and not self.restarting:
            logger.error("scheduler actor is gone (%s); starting a new one", error)
            self.restart_task = background_task(self._restart())

    async def _restart(self) -> None:
        """Create or adopt the scheduler actor by name until one answers; it builds its workers on first use."""
        attempt = 0
        while True:
            try:
                engine = await asyncio.to_thread(self.create_engine)
                await asyncio.wait_for(engine.attach.remote(self.client_id), ENGINE_READY_TIMEOUT_S)
            except Exception as error:
                # The dead actor's name can outlive it for a moment, and a start can fail: try again, slower.
                self.restart_error = f"{type(error).__name__}: {short_reason(error)}"
                logger.warning("scheduler actor restart attempt %d failed: %s", attempt + 1, self.restart_error)
                await asyncio.sleep(RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)])
                attempt += 1
                continue
            self.engine = engine
            self.engine_error = None
            self.restart_error = None
            self.num_restarts += 1
            logger.info("scheduler actor is back (restart %d)", self.num_restarts)
            return

    async def check_health(self) -> None:
        """Raises while the engine is down, restarting or draining."""
        self._raise_if_restarting()
        try:
            await self.engine.check_health.remote()
        except Exception as error:
            self.on_engine_error(error)
            raise unwrap_ray_error(error) from None

    async def ping(self) -> None:
        """Raises only when the scheduler actor is gone and could not be replaced (Serve then replaces us)."""
        if self.restarting:
            return
        try:
            await self.engine.ping.remote(self.client_id)
        except Exception as error:
            self.on_engine_error(error)
            if not self.restarting:
                raise

    def _ensure_pump(self) -> None:
        if self.pump_task is None or self.pump_task.done():
            self.engine_error = None
            self.pump_task = background_task(self._pump())

    async def _pump(self) -> None:
        """One output stream from the engine brings every new token of every request of this replica, a batch
        per step; it ends when nothing is left in flight, and a request submitted meanwhile starts the next."""
        if self.transport == "socket":
            await self._pump_channel()
            return
        while self.queues:
            self._drop_orphans()
            self.submitted.clear()
            received = False
            try:
                async for batch in open_output_stream(self.engine, self.client_id):
                    received = True
                    self._dispatch(await batch)
                    self._drop_orphans()
            except Exception as error:
                self._fail_queues(error)
                return
            if not received:
                # Nothing of ours in flight there (final outputs still wait for their readers): until a new request
                # comes, look again at the pace of a poll rather than in a loop of Ray calls.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.submitted.wait(), OUTPUT_POLL_TIMEOUT_S)

    async def _pump_channel(self) -> None:
        """The same over the output channel, which stays open between pumps (the engine sends an empty batch at
        least every OUTPUT_POLL_TIMEOUT_S, so orphans are still looked for while nothing comes)."""
        while self.queues:
            self._drop_orphans()
            try:
                batch = await self._next_channel_batch()
            except Exception as error:
                self._fail_queues(error)
                return
            self._dispatch(batch)

    async def _next_channel_batch(self) -> list[EngineOutput]:
        channel = self.output_channel
        if channel is None or channel.engine is not self.engine:
            if channel is not None:
                channel.close()  # the engine was replaced
            self.output_channel = None
            try:
                channel = await OutputChannel.connect(self.engine, self.client_id)
            except OSError as error:
                raise EngineDeadError(f"cannot reach the scheduler actor's output channel: {error}") from error
            self.output_channel = channel
        try:
            return await channel.next_batch()
        except OutputChannelClosedError:
            self.output_channel = None
            # Closed with no error sent: raises RayActorError if the scheduler actor died, else connect again.
            await self.engine.ping.remote(self.client_id)
            return []
        except BaseException:
            self.output_channel = None  # the engine sent a failure and hung up
            raise

    def _fail_queues(self, error: BaseException) -> None:
        """The engine failed this client's requests or is unreachable: every reader gets the error."""
        self.engine_error = unwrap_ray_error(error)
        logger.error("engine unreachable: %s", self.engine_error)
        for queue in self.queues.values():
            queue.put_nowait(self.engine_error)
        self.on_engine_error(error)

    def _dispatch(self, outputs: list[EngineOutput]) -> None:
        by_request: dict[str, list[EngineOutput]] = defaultdict(list)
        for output in outputs:
            by_request[output.request_id].append(output)
        for request_id, request_outputs in by_request.items():
            queue = self.queues.get(request_id)
            if queue is not None:
                queue.put_nowait(request_outputs)

    def _drop_orphans(self) -> None:
        """Abort requests that nobody ever started reading: their reader is gone without saying so."""
        deadline = time.monotonic() - ORPHAN_QUEUE_S
        for request_id in list(self.queues):
            if request_id not in self.reading and self.queued_at.get(request_id, 0.0) < deadline:
                logger.warning("request %s found no reader in %.0f s; aborting it", request_id, ORPHAN_QUEUE_S)
                self.cancel(request_id)

    async def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Queue the request in the engine. Raises ValueError (bad input), EngineOverloadedError (queue full),
        EngineDeadError (engine down) or EngineDrainingError (shutting down) before anything is streamed, so the
        client still gets a plain HTTP error."""
        self._raise_if_restarting()
        self.queues[request_id] = asyncio.Queue()
        self.queued_at[request_id] = time.monotonic()
        admitted = asyncio.get_running_loop().create_future()
        self.pending_admissions.append((request_id, list(prompt_token_ids), params, admitted))
        if self.admit_task is None or self.admit_task.done():
            self.admit_task = background_task(self._send_admissions())
        try:
            refusal = await admitted
        except Exception as error:
            # A call cancelled with its HTTP request (Serve cancels recursively) may have run all the same: abort.
            self.cancel(request_id)
            self.on_engine_error(error)
            error = unwrap_ray_error(error)
            self._note_down(error)
            raise error from None
        if refusal is not None:
            self._forget(request_id)  # never queued there: nothing to abort
            self._note_down(refusal)
            raise refusal
        self.submitted.set()
        self._ensure_pump()

    @property
    def available(self) -> bool:
        return time.monotonic() >= self.unavailable_until

    def _note_down(self, error: BaseException) -> None:
        if isinstance(error, EngineDeadError):
            self.unavailable_until = time.monotonic() + UNAVAILABLE_BACKOFF_S

    async def _send_admissions(self) -> None:
        """Every request submitted since the last call, in one Ray call: a burst of arrivals (64 at once) costs a
        few calls, not one each. The first goes out at once; those that come while it is in flight go next."""
        while self.pending_admissions:
            # A submitter cancelled meanwhile (its client left) has sent its abort already: leave it out.
            batch = [item for item in self.pending_admissions if not item[3].done()]
            self.pending_admissions = []
            if not batch:
                continue
            try:
                refusals = await self.engine.add_requests.remote(
                    self.client_id, [(request_id, token_ids, params) for request_id, token_ids, params, _ in batch]
                )
            except Exception as error:
                for *_, admitted in batch:
                    if not admitted.done():
                        admitted.set_exception(error)
                continue
            for (*_, admitted), refusal in zip(batch, refusals, strict=True):
                if not admitted.done():
                    admitted.set_result(refusal)

    async def outputs(self, request_id: str, num_completions: int) -> AsyncIterator[list[EngineOutput]]:
        """Yields a submitted request's outputs, one list per engine step while the reader keeps up (steps that
        piled up come merged, one output per completion), until every completion finished.

        Leaving early (client gone, stop string, timeout) aborts the request in the engine, which frees its blocks.
        """
        queue = self.queues.get(request_id)
        if queue is None:
            raise EngineDeadError(f"request {request_id} was aborted: nobody read it for {ORPHAN_QUEUE_S:.0f} s")
        num_unfinished = num_completions
        self.reading.add(request_id)
        try:
            while num_unfinished:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                outputs = merge_outputs(item for item in items if not isinstance(item, BaseException))
                if outputs:
                    num_unfinished -= sum(1 for output in outputs if output.finish_reason is not None)
                    yield outputs
                errors = [item for item in items if isinstance(item, BaseException)]
                if errors and num_unfinished:
                    raise errors[0]
        finally:
            self.reading.discard(request_id)
            if num_unfinished:
                self.cancel(request_id)
            else:
                self._forget(request_id)

    def _forget(self, request_id: str) -> bool:
        """Drop the request's queue here; False if it had none (already forgotten)."""
        self.queued_at.pop(request_id, None)
        return self.queues.pop(request_id, None) is not None

    def cancel(self, request_id: str) -> None:
        """Drop a submitted request nobody will read and abort it in the engine (idempotent, never waits)."""
        if not self._forget(request_id):
            return
        self.pending_aborts.add(request_id)
        if self.abort_task is None or self.abort_task.done():
            self.abort_task = background_task(self._send_aborts())

    async def _send_aborts(self) -> None:
        """Every abort asked for since the last call, in one Ray call; runs apart from the (maybe cancelled) caller."""
        while self.pending_aborts:
            request_ids = sorted(self.pending_aborts)
            self.pending_aborts.clear()
            try:
                await self.engine.abort.remote(request_ids)
            except Exception as error:
                logger.warning("abort of %d requests failed: %s", len(request_ids), error)

    async def stop_completion(self, request_id: str, index: int, stop_string: str) -> None:
        try:
            await self.engine.stop_completion.remote(request_id, index, stop_string)
        except Exception as error:
            self.on_engine_error(error)
            raise unwrap_ray_error(error) from None
