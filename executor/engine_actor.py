"""The scheduler actor: one per engine replica. Owns the EngineCore, runs the step loop in the background,
and hands outputs to each ingress replica over one output stream, a batch per step (never one Ray message per token
per request).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Container, Coroutine, Sequence
from typing import Any

from configs.engine_config import EngineConfig
from configs.sampling_params import SamplingParams
from executor.engine_core import EngineCore, EngineOutput
from executor.errors import EngineDeadError, EngineDrainingError, EngineOverloadedError, short_reason
from executor.executors import RayExecutor
from executor.heap import freeze_startup_heap, thaw_heap
from executor.output_channel import accept_client, send_outputs
from executor.step_channel import SECRET_BYTES
from model_executor.model_fetch import resolve_model
from model_executor.model_info import load_model_info

logger = logging.getLogger(__name__)

OUTPUT_POLL_TIMEOUT_S = 2.0
# Batches an output stream may run ahead of its reader; beyond that it waits, and later steps merge into one batch.
OUTPUT_STREAM_AHEAD = 2
# An ingress with requests here reads (or polls) at least every OUTPUT_POLL_TIMEOUT_S; silent this long, it is gone:
# abort its requests.
REQUEST_LEASE_S = 15.0
# Every live ingress pings on Serve's health check (every 10 s); silent this long, it no longer counts as attached.
CLIENT_LEASE_S = 60.0
# How long an abort that arrived before its request is remembered (Ray may run an async actor's calls out of order).
EARLY_ABORT_MEMORY_S = 120.0


def background_task(coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task:
    """A task that outlives the Ray call that starts it.

    A task created inside an actor call inherits that call's Ray task id through contextvars, and Ray cancels a
    cancelled call's children recursively: a client that disconnects while its call starts the step loop (or an
    output pump, or an abort) would otherwise cancel the model workers' step under everyone.
    """
    return asyncio.get_running_loop().create_task(coroutine, context=contextvars.Context())


def open_output_stream(engine: Any, client_id: str, ahead: int = OUTPUT_STREAM_AHEAD) -> Any:
    """`engine.stream_outputs(client_id)` as a Ray streaming generator (iterate it for one ObjectRef per batch),
    with the backpressure its batching rests on: at most `ahead` batches ahead of the reader."""
    return engine.stream_outputs.options(num_returns="streaming", _generator_backpressure_num_objects=ahead).remote(
        client_id
    )


def process_rss_bytes() -> int:
    """Resident memory of this process (Linux /proc; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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


class EngineActor:
    """Token ids in, token ids out. Wrap with `ray.remote`; every public method is async."""

    def __init__(
        self,
        config: EngineConfig,
        engine_index: int = 0,
        request_lease_s: float = REQUEST_LEASE_S,
        orphan_timeout_s: float | None = None,
    ):
        """`orphan_timeout_s`: an engine shared by ingress replicas (a detached actor) ends itself, workers and
        placement group included, once no ingress has been heard from for this long; None: never."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.config = config
        self.engine_index = engine_index
        self.request_lease_s = request_lease_s
        self.orphan_timeout_s = orphan_timeout_s
        self.client_seen: dict[str, float] = {}
        self.last_client_activity = time.monotonic()
        # Ingresses inside attach, waiting for the engine to start: present, however long the start takes.
        self.num_attaching = 0
        self.terminating = False
        self.reaper_task: asyncio.Task | None = None
        self.early_aborts: dict[str, float] = {}
        # Kept apart from client_failures, which a new add_request clears: only the client's next poll may.
        self.client_lease_failures: dict[str, tuple[str, float]] = {}
        self.draining = False
        self.core: EngineCore | None = None
        self.start_task: asyncio.Task | None = None
        self.client_outputs: dict[str, list[EngineOutput]] = defaultdict(list)
        self.client_events: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        # The one live output stream of each client (a newer one supersedes it).
        self.client_streams: dict[str, object] = {}
        self.request_client: dict[str, str] = {}
        self.new_work = asyncio.Event()
        self.loop_task: asyncio.Task | None = None
        self.dead_reason: str | None = None
        self.client_failures: dict[str, str] = {}
        self.rebuild_task: asyncio.Task | None = None
        self.num_rebuilds = 0
        self.num_steps = 0
        self.stream_buffer = StreamIntervalBuffer(config.stream_interval)
        self.output_server_task: asyncio.Task | None = None
        self.output_secret = os.urandom(SECRET_BYTES)

    def _build_core(self) -> EngineCore:
        import ray

        # The model runs on the workers' nodes, not here: decide CUDA from what the cluster offers.
        cluster_has_gpus = ray.cluster_resources().get("GPU", 0) >= 1
        model_info = load_model_info(resolve_model(self.config.model), self.config, cuda_available=cluster_has_gpus)
        return EngineCore(self.config, model_info, RayExecutor(self.config, model_info), self.engine_index)

    async def _started(self) -> EngineCore:
        """Workers are created on first use, in a thread: the event loop keeps answering meanwhile. The start is
        one task of its own, so a caller that gives up (cancelled) neither stops it nor makes the next one start
        a second set of workers."""
        if self.core is None:
            self._raise_if_dead()
            if self.start_task is None:
                self.start_task = background_task(self._start())
            await asyncio.shield(self.start_task)
        return self.core

    async def _new_core(self) -> EngineCore:
        """Workers up (in a thread: the event loop keeps answering), then their step channels opened on this loop."""
        core = await asyncio.to_thread(self._build_core)
        if self.config.transport == "socket":
            try:
                await core.executor.open_step_channels()
            except BaseException:
                await asyncio.to_thread(core.shutdown)
                raise
        return core

    async def _start(self) -> None:
        try:
            self.core = await self._new_core()
        except Exception as error:
            self.dead_reason = f"engine failed to start: {short_reason(error)}"
            raise
        freeze_startup_heap("scheduler actor")

    def _ensure_loop(self) -> None:
        if self.loop_task is None or self.loop_task.done():
            self.loop_task = background_task(self._run_steps())
        self._ensure_watcher()

    def _ensure_watcher(self) -> None:
        if self.reaper_task is None or self.reaper_task.done():
            self.reaper_task = background_task(self._watch_clients())

    def _touch(self, client_id: str) -> None:
        self.client_seen[client_id] = self.last_client_activity = time.monotonic()

    def _forget_client(self, client_id: str, failure: str | None = None) -> list[str]:
        """Drop a client and abort its requests (nobody reads them any more); returns their ids. With `failure`,
        a client that polls again after all learns its requests were ended, instead of waiting for them."""
        request_ids = [request_id for request_id, owner in self.request_client.items() if owner == client_id]
        if request_ids and self.core is not None:
            self.core.abort_request(request_ids)
        for request_id in request_ids:
            self.request_client.pop(request_id, None)
        self.stream_buffer.retain(self.request_client)
        for table in (self.client_seen, self.client_outputs, self.client_events, self.client_failures):
            table.pop(client_id, None)
        if failure is not None:
            self.client_lease_failures[client_id] = (failure, time.monotonic())
        return request_ids

    async def _watch_clients(self) -> None:
        """Abort the requests of an ingress that stopped reading its outputs (it died), forget ingresses gone
        quiet, and end this engine when no ingress is left at all."""
        period = min(self.request_lease_s, self.orphan_timeout_s or self.request_lease_s) / 4
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            polling = set(self.request_client.values())
            for client_id, seen in list(self.client_seen.items()):
                if client_id in polling and seen < now - self.request_lease_s:
                    failure = (
                        f"the ingress did not read its outputs for {self.request_lease_s:.0f} s; "
                        "its requests were aborted"
                    )
                    request_ids = self._forget_client(client_id, failure)
                    logger.warning("ingress %s went silent: aborted its %d requests", client_id, len(request_ids))
                elif seen < now - CLIENT_LEASE_S:
                    self._forget_client(client_id)
            for client_id, (_, since) in list(self.client_lease_failures.items()):
                if since < now - CLIENT_LEASE_S:
                    del self.client_lease_failures[client_id]  # that ingress is gone for good
            silent_s = now - self.last_client_activity
            if self.orphan_timeout_s is not None and not self.num_attaching and silent_s > self.orphan_timeout_s:
                logger.warning("no ingress for %.0f s: this engine ends itself", self.orphan_timeout_s)
                await self._terminate()
                return

    async def _terminate(self) -> None:
        """Release the workers and placement group, then end this actor (its name frees for a new one)."""
        import ray

        self.terminating = True
        await self.shutdown()
        ray.kill(ray.get_runtime_context().current_actor)

    async def attach(self, client_id: str) -> dict[str, Any]:
        """An ingress replica starts using this engine: engine_info plus the config this engine runs. Raises
        EngineDrainingError when this engine is ending (create a new one once it is gone)."""
        if self.terminating:
            raise EngineDrainingError("this engine is ending: its last ingress left")
        self._touch(client_id)
        self._ensure_watcher()
        self.num_attaching += 1
        try:
            info = await self.engine_info()
        finally:
            self.num_attaching -= 1
            self._touch(client_id)
        return {**info, "engine_config": self.config.model_dump()}

    async def detach(self, client_id: str) -> int:
        """An ingress replica stops (gracefully): forget it. The last one to leave a shared engine ends it.
        Returns how many ingresses remain."""
        self._forget_client(client_id)
        remaining = len(self.client_seen)
        if not remaining and self.orphan_timeout_s is not None and not self.terminating:
            logger.info("the last ingress detached: this engine ends itself")
            self.terminating = True
            background_task(self._terminate())
        return remaining

    def _raise_if_dead(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    async def engine_info(self) -> dict[str, Any]:
        """What an ingress needs to validate requests the way the engine will."""
        await self._started()
        info = self.core.model_info
        return {
            "max_model_len": info.max_model_len,
            "vocab_size": info.vocab_size,
            "num_kv_blocks": self.core.executor.num_kv_blocks,
            "block_size": self.config.block_size,
        }

    async def add_request(
        self, client_id: str, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        """Raises ValueError on bad input (nothing is queued), EngineOverloadedError when the waiting queue is
        full, EngineDeadError once the engine is down and EngineDrainingError while the server shuts down."""
        (refusal,) = await self.add_requests(client_id, [(request_id, prompt_token_ids, params)])
        if refusal is not None:
            raise refusal

    async def add_requests(
        self, client_id: str, requests: Sequence[tuple[str, Sequence[int], SamplingParams]]
    ) -> list[Exception | None]:
        """Queue (request_id, prompt_token_ids, params) in order; one Ray call for a burst of arrivals. Returns,
        per request, None or why it was refused (ValueError: bad input; EngineOverloadedError: queue full);
        raises EngineDeadError / EngineDrainingError for all of them."""
        if self.draining:
            raise EngineDrainingError("the server is shutting down and takes no new requests")
        await self._started()
        self._raise_if_dead()
        self._ensure_loop()
        self._touch(client_id)
        refusals = [self._admit(client_id, *request) for request in requests]
        self.new_work.set()
        return refusals

    def _admit(
        self, client_id: str, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> Exception | None:
        """Queue one request in the core; returns why it was refused, if it was."""
        if self.early_aborts.pop(request_id, None) is not None:
            return None  # its abort overtook it: the client is gone already
        try:
            self.core.add_request(request_id, prompt_token_ids, params)
        except (ValueError, EngineOverloadedError) as refusal:
            return refusal
        # Requests of this client from before a rebuild were already failed, however its pump learnt it.
        self.client_failures.pop(client_id, None)
        self.request_client[request_id] = client_id
        return None

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Stop requests and free their blocks. An async actor may run this before the add_request it follows:
        an unknown id is remembered for a while, and that request is dropped when it arrives."""
        await self._started()
        now = time.monotonic()
        for request_id in request_ids:
            if request_id not in self.core.children:
                self.early_aborts[request_id] = now
        if len(self.early_aborts) > 1024:
            self.early_aborts = {
                request_id: when for request_id, when in self.early_aborts.items() if when > now - EARLY_ABORT_MEMORY_S
            }
        self.core.abort_request(request_ids)
        for request_id in request_ids:
            self.request_client.pop(request_id, None)
        self.stream_buffer.retain(self.request_client)

    async def stop_completion(self, request_id: str, index: int, stop_string: str) -> None:
        await self._started()
        self.core.stop_completion(request_id, index, stop_string)
        self.stream_buffer.drop(request_id, index)
        if request_id not in self.core.children:
            self.request_client.pop(request_id, None)

    async def get_outputs(self, client_id: str) -> list[EngineOutput]:
        """Everything produced for this client's requests since its last call; waits briefly when empty."""
        await self._await_outputs(client_id)
        return self._take_outputs(client_id)

    async def _await_outputs(self, client_id: str) -> None:
        """The client is alive (lease renewed); raises its pending failure, else waits up to OUTPUT_POLL_TIMEOUT_S
        for outputs."""
        self._touch(client_id)
        failure = self.client_failures.pop(client_id, None)
        if failure is None and client_id in self.client_lease_failures:
            failure = self.client_lease_failures.pop(client_id)[0]
        if failure is not None:
            raise EngineDeadError(failure)
        await self._started()
        self._ensure_loop()
        if not self.client_outputs.get(client_id):
            self._raise_if_dead()
            # asyncio.timeout, not wait_for: this runs once per step per client, and wait_for wraps it in a task.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(OUTPUT_POLL_TIMEOUT_S):
                    await self.client_events[client_id].wait()

    def _take_outputs(self, client_id: str) -> list[EngineOutput]:
        self.client_events[client_id].clear()
        outputs = self.client_outputs.pop(client_id, [])
        if not outputs:
            self._raise_if_dead()
        return outputs

    async def stream_outputs(self, client_id: str) -> AsyncIterator[list[EngineOutput]]:
        """get_outputs as a stream (call with num_returns="streaming"): one Ray message per batch instead of a call
        and its reply. Each batch holds everything new since the last; an empty one every OUTPUT_POLL_TIMEOUT_S
        while the client's requests produce nothing. Open it with `open_output_stream`: a reader that lags (its
        backpressure) holds the stream at its yield (no lease renewal meanwhile) while later steps pile up into one
        batch. Ends once this client has nothing in flight and nothing undelivered, or a newer stream of the same
        client started; raises what get_outputs raises."""
        stream = object()
        self.client_streams[client_id] = stream
        try:
            while self.client_outputs.get(client_id) or self._client_in_flight(client_id):
                await self._await_outputs(client_id)
                if self.client_streams.get(client_id) is not stream:
                    return  # superseded: what came is the newer stream's
                yield self._take_outputs(client_id)
        finally:
            if self.client_streams.get(client_id) is stream:
                del self.client_streams[client_id]

    async def open_output_channel(self) -> tuple[str, int, bytes]:
        """Where an ingress connects to read its outputs over a socket instead of `stream_outputs` (see
        executor.output_channel): (host, port, secret)."""
        if self.output_server_task is None:
            self.output_server_task = background_task(self._start_output_server())
        server = await asyncio.shield(self.output_server_task)
        host, port = server.sockets[0].getsockname()[:2]
        return host, port, self.output_secret

    async def _start_output_server(self) -> asyncio.Server:
        import ray

        return await asyncio.start_server(self._serve_output_connection, ray.util.get_node_ip_address(), 0)

    async def _serve_output_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client_id = await accept_client(reader, self.output_secret)
        if client_id is None:
            logger.warning("output channel refused a connection without the secret")
            writer.close()
            return
        connection = object()
        self.client_streams[client_id] = connection  # supersedes any older stream or connection of this client
        try:
            await send_outputs(
                writer,
                lambda: self._await_outputs(client_id),
                lambda: self._take_outputs(client_id),
                lambda: self.client_streams.get(client_id) is not connection,
            )
        finally:
            if self.client_streams.get(client_id) is connection:
                del self.client_streams[client_id]

    def _client_in_flight(self, client_id: str) -> bool:
        """Requests of this client still running, or a failure it has not been told of yet."""
        failed = client_id in self.client_failures or client_id in self.client_lease_failures
        return failed or client_id in self.request_client.values()

    async def check_health(self) -> None:
        """Raises while the engine is down or draining; a worker found dead here starts the rebuild."""
        if self.draining:
            raise EngineDrainingError("the server is shutting down")
        core = await self._started()
        try:
            await core.executor.check_health_async()
        except EngineDeadError as error:
            if self.core is core and not self._rebuilding():
                logger.error("health check found a dead worker: %s; rebuilding the engine", error)
                if self.loop_task is not None:
                    self.loop_task.cancel()
                self._start_rebuild(short_reason(error))
            raise

    async def stats(self) -> dict[str, Any]:
        await self._started()
        scheduler = self.core.scheduler
        kv_cache = scheduler.kv_cache
        return {
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "num_free_blocks": kv_cache.num_free_blocks,
            "num_kv_blocks": kv_cache.pool.num_blocks,
            "kv_cache_usage": kv_cache.usage,
            "num_preemptions": scheduler.num_preemptions,
            "prefix_cache_queries": kv_cache.prefix_cache_queries,
            "prefix_cache_hits": kv_cache.prefix_cache_hits,
            "num_steps": self.num_steps,
            "num_steps_planned_ahead": self.core.num_steps_planned_ahead,
            "num_rebuilds": self.num_rebuilds,
            "num_clients": len(self.client_seen),
            "draining": self.draining,
            "rss_bytes": process_rss_bytes(),
            # Per-request bookkeeping, all zero when idle (leak checks).
            "num_tracked_requests": len(self.request_client) + len(self.core.children) + len(self.stream_buffer),
            "num_undelivered_outputs": sum(map(len, self.client_outputs.values())),
            "num_early_aborts": len(self.early_aborts),
        }

    async def metrics_text(self) -> bytes:
        """Prometheus exposition of this engine's metrics, gauges read now."""
        await self._started()
        self.core.metrics.update_from_scheduler(self.core.scheduler)
        return self.core.metrics.exposition()

    async def worker_handles(self) -> list[Any]:
        """The model worker actors, for operators (and fault-injection tests)."""
        await self._started()
        return list(self.core.executor.workers)

    async def topology(self) -> dict[str, Any]:
        """This actor's process and its model workers' (rank, pid): proof the layers really are separate actors."""
        await self._started()
        workers = await asyncio.gather(*[worker.identity.remote() for worker in self.core.executor.workers])
        placement_group = self.core.executor.placement_group
        return {
            "engine_pid": os.getpid(),
            "workers": list(workers),
            "placement_group_id": placement_group.id.hex() if placement_group is not None else None,
        }

    async def _run_steps(self) -> None:
        """Plan, start, collect. With async scheduling the next step is planned and queued on the workers before
        the running one returns, so the workers never wait for the scheduler between steps."""
        core = self.core
        depth = 2 if self.config.uses_async_scheduling() else 1
        while True:
            has_work = core.has_unfinished_requests()
            if not has_work and not core.steps_in_flight:
                self.new_work.clear()
                await self.new_work.wait()
                continue
            try:
                submitted = has_work and len(core.steps_in_flight) < depth and core.submit_step()
                if len(core.steps_in_flight) < depth and submitted:
                    continue
                outputs = await core.finish_oldest_step()
                if not core.steps_in_flight and core.has_unfinished_requests():
                    # The workers are idle (a step with drafts, or no async scheduling): the next step goes before
                    # these outputs are handed on.
                    core.submit_step()
            except Exception as error:
                logger.exception("engine step failed; failing in-flight requests and rebuilding the engine")
                core.abandon_steps_in_flight()
                if not self._rebuilding():
                    self._start_rebuild(f"engine step failed: {short_reason(error)}")
                return
            self.num_steps += 1
            finished_request_ids = set()
            for output in outputs:
                client_id = self.request_client.get(output.request_id)
                if client_id is None:
                    continue
                output = self.stream_buffer.push(output)
                if output is None:
                    continue
                self.client_outputs[client_id].append(output)
                self.client_events[client_id].set()
                if output.finish_reason is not None:
                    finished_request_ids.add(output.request_id)
            # Forget a request's client only after the whole step: its n completions may finish together.
            for request_id in finished_request_ids:
                if request_id not in self.core.children:
                    self.request_client.pop(request_id, None)
            # Yield so queued add_request / abort calls land between steps.
            await asyncio.sleep(0)

    def _rebuilding(self) -> bool:
        return self.rebuild_task is not None and not self.rebuild_task.done()

    def _start_rebuild(self, reason: str) -> None:
        self._fail_in_flight(reason)
        self.rebuild_task = background_task(self._rebuild())

    def _fail_in_flight(self, reason: str) -> None:
        """The engine is down: every client with requests in flight learns it from its next get_outputs."""
        self.dead_reason = reason
        self._fail_clients(reason)

    def _fail_clients(self, reason: str) -> None:
        """Every client with requests in flight gets one EngineDeadError(reason) from its next get_outputs."""
        for client_id in set(self.request_client.values()):
            self.client_failures[client_id] = reason
            self.client_outputs.pop(client_id, None)
        self.request_client.clear()
        self.stream_buffer.retain(self.request_client)
        for event in self.client_events.values():
            event.set()

    async def _rebuild(self) -> None:
        """Replace the failed workers, placement group and scheduler state; serve again when done."""
        failed_core, self.core = self.core, None
        try:
            await asyncio.to_thread(failed_core.shutdown)
        except Exception:
            logger.exception("cleaning up the failed engine")
        # The failed engine is frozen with the start-up heap: thawed, its cycles go at the next freeze's collect.
        del failed_core
        thaw_heap()
        try:
            self.core = await self._new_core()
        except Exception as error:
            self.dead_reason = f"engine rebuild failed: {short_reason(error)}"
            logger.exception("engine rebuild failed; the engine stays down")
            return
        self.loop_task = None
        freeze_startup_heap("scheduler actor")
        self.num_rebuilds += 1
        self.dead_reason = None
        logger.info("engine rebuilt (%d so far); serving again", self.num_rebuilds)

    async def ping(self, client_id: str | None = None) -> bool:
        """Alive (even while rebuilding): what Ray Serve's replica health check asks; keeps the ingress attached."""
        if client_id is not None:
            self._touch(client_id)
        return True

    async def drain(self) -> None:
        """Graceful shutdown, step 1: refuse new requests (and fail /health); the ones in flight go on."""
        self.draining = True

    async def fail_requests(self, reason: str) -> int:
        """Graceful shutdown, step 2 (grace over): end every request in flight with `reason`, free its blocks."""
        if self.core is None:
            return 0
        request_ids = list(self.core.children)
        self.core.abort_request(request_ids)
        self._fail_clients(reason)
        return len(request_ids)

    async def shutdown(self) -> None:
        for task in (self.loop_task, self.reaper_task):
            if task is not None:
                task.cancel()
        if self.output_server_task is not None and self.output_server_task.done():
            with contextlib.suppress(Exception):
                self.output_server_task.result().close()
        if self.core is not None:
            self.core.shutdown()
