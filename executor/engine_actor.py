"""The scheduler actor: one per engine replica. Owns the EngineCore and its lifecycle (start, step loop, rebuild,
drain, shutdown, health); a ClientRegistry keeps which ingress replicas use it, and an OutputRouter hands each one its
outputs, a batch per step (never one Ray message per token per request).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from configs.engine_config import EngineConfig
from configs.sampling_params import SamplingParams
from executor.client_registry import ClientRegistry
from executor.engine_core import EngineCore, EngineOutput
from executor.errors import EngineDeadError, EngineDrainingError, EngineOverloadedError, short_reason
from executor.executors import PLACEMENT_TIMEOUT_S, RayExecutor, dead_node_ids
from executor.heap import freeze_startup_heap, thaw_heap
from executor.output_router import OUTPUT_POLL_TIMEOUT_S, OutputRouter
from executor.outputs import EngineInfo, EngineStats, EngineTopology
from executor.stats_logger import LoggingStatLogger
from model_executor.model_fetch import resolve_configured_model
from model_executor.model_info import load_model_info

__all__ = [
    "OUTPUT_POLL_TIMEOUT_S",
    "OUTPUT_STREAM_AHEAD",
    "REQUEST_LEASE_S",
    "EngineActor",
    "background_task",
    "open_output_stream",
    "process_rss_bytes",
]

logger = logging.getLogger(__name__)

# Batches an output stream may run ahead of its reader; beyond that it waits, and later steps merge into one batch.
OUTPUT_STREAM_AHEAD = 2
# An ingress with requests here reads (or polls) at least every OUTPUT_POLL_TIMEOUT_S; silent this long, it is gone:
# abort its requests.
REQUEST_LEASE_S = 15.0
# How often the scheduler actor pings its workers: a worker lost with its node while the engine is idle is replaced
# before the next request needs it.
WORKER_WATCH_PERIOD_S = 10.0


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
        self.clients = ClientRegistry(request_lease_s, orphan_timeout_s)
        self.router = OutputRouter(
            self.clients, config.scheduler.stream_interval, self._ensure_running, self._raise_if_dead, self._hung_up
        )
        self.core: EngineCore | None = None
        self.start_task: asyncio.Task | None = None
        self.loop_task: asyncio.Task | None = None
        self.watcher_task: asyncio.Task | None = None
        self.rebuild_task: asyncio.Task | None = None
        self.output_server_task: asyncio.Task | None = None
        self.worker_watch_task: asyncio.Task | None = None
        self.stats_logger = LoggingStatLogger(engine_index)
        self.stats_task: asyncio.Task | None = None
        self.new_work = asyncio.Event()
        self.dead_reason: str | None = None
        self.draining = False
        self.terminating = False
        self.num_rebuilds = 0
        self.num_steps = 0

    # Lifecycle: start, step loop, rebuild, end.

    def _build_core(self, on_placement_wait: Callable[[str], None] | None = None) -> EngineCore:
        """The workers and the scheduler over them. With `on_placement_wait` (a rebuild) the workers' placement
        waits until the cluster can place them, reporting what it waits for; without, it times out."""
        import ray

        # The model runs on the workers' nodes, not here: decide CUDA from what the cluster offers.
        cluster_has_gpus = ray.cluster_resources().get("GPU", 0) >= 1
        # Config and tokenizer only: the workers fetch the weights on their nodes, at the commit read here.
        model_dir = resolve_configured_model(self.config.model, weights=False)
        model_info = load_model_info(model_dir, self.config, cuda_available=cluster_has_gpus)
        # A rebuild's placement waits without a deadline (the pending placement group is what an autoscaler acts on).
        placement_timeout_s = PLACEMENT_TIMEOUT_S if on_placement_wait is None else None
        executor = RayExecutor(self.config, model_info, placement_timeout_s, on_placement_wait)
        return EngineCore(self.config, model_info, executor, self.engine_index)

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

    async def _new_core(self, on_placement_wait: Callable[[str], None] | None = None) -> EngineCore:
        """Workers up (in a thread: the event loop keeps answering), then their step channels opened on this loop."""
        core = await asyncio.to_thread(self._build_core, on_placement_wait)
        loop = asyncio.get_running_loop()
        # A compiled grammar can make a waiting request runnable while the loop sleeps.
        core.on_grammar_ready = lambda: loop.call_soon_threadsafe(self.new_work.set)
        if self.config.runtime.transport == "socket":
            try:
                await core.open_step_channels()
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
        # vLLM's periodic stats line, from a timer of its own (no work in the step loop); it follows rebuilds.
        self.stats_task = background_task(self.stats_logger.run(lambda: self.core))
        self.worker_watch_task = background_task(self._watch_workers())
        freeze_startup_heap("scheduler actor")

    async def _ensure_running(self) -> None:
        """The engine started and its step loop running (what a reader waits for)."""
        await self._started()
        self._ensure_loop()

    def _ensure_loop(self) -> None:
        if self.loop_task is None or self.loop_task.done():
            self.loop_task = background_task(self._run_steps())
        self._ensure_watcher()

    def _ensure_watcher(self) -> None:
        if self.watcher_task is None or self.watcher_task.done():
            self.watcher_task = background_task(self.clients.watch(self._forget_client, self._terminate))

    def _raise_if_dead(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    async def _run_steps(self) -> None:
        """Plan, start, collect. With async scheduling the next step is planned and queued on the workers before
        the running one returns, so the workers never wait for the scheduler between steps."""
        core = self.core
        depth = 2 if self.config.uses_async_scheduling() else 1
        while True:
            has_work = core.has_unfinished_requests()
            if not has_work and not core.num_steps_in_flight:
                self.new_work.clear()
                await self.new_work.wait()
                continue
            try:
                submitted = has_work and core.num_steps_in_flight < depth and core.submit_step()
                if core.num_steps_in_flight < depth and submitted:
                    continue
                if not core.num_steps_in_flight:
                    # Nothing could run: every request waits for its grammar to compile (which sets new_work).
                    self.new_work.clear()
                    if core.waits_only_for_grammars():
                        await self.new_work.wait()
                    continue
                outputs = await core.finish_oldest_step()
                if not core.num_steps_in_flight and core.has_unfinished_requests():
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
            finished_request_ids = self.router.deliver(outputs)
            # Forget a request's client only after the whole step: its n completions may finish together.
            self.clients.forget_requests(
                request_id for request_id in finished_request_ids if not core.has_request(request_id)
            )
            # Yield so queued add_request / abort calls land between steps.
            await asyncio.sleep(0)

    def _rebuilding(self) -> bool:
        return self.rebuild_task is not None and not self.rebuild_task.done()

    def _start_rebuild(self, reason: str) -> None:
        """The engine is down: every client with requests in flight learns it from its next read."""
        self.dead_reason = reason
        self.router.fail(self.clients.release_all_requests(), reason)
        self.rebuild_task = background_task(self._rebuild())

    async def _rebuild(self) -> None:
        """Replace the failed workers, placement group and scheduler state; serve again when done. Where the
        cluster has no room for the workers now (their node is gone), it waits until it has, the reason for the
        outage and what the placement waits for in `dead_reason` meanwhile."""
        failed_core, self.core = self.core, None
        failure = self.dead_reason
        # Where the failed workers ran: the rebuild's status says once Ray declares one of those nodes dead.
        failed_nodes = {
            identity["node_id"] for identity in getattr(failed_core.executor, "worker_identities", []) if identity
        } - {None}
        try:
            await asyncio.to_thread(failed_core.shutdown)
        except Exception:
            logger.exception("cleaning up the failed engine")
        # The failed engine is frozen with the start-up heap: thawed, its cycles go at the next freeze's collect.
        del failed_core
        thaw_heap()
        loop = asyncio.get_running_loop()

        def on_placement_wait(status: str) -> None:
            """In the build's thread: give up once this engine ends, else say what the rebuild waits for."""
            if self.terminating or self.draining:
                raise EngineDrainingError("the engine is ending: its rebuild stopped waiting for resources")
            lost = sorted(node_id[:12] for node_id in failed_nodes & dead_node_ids())
            if lost:
                status = f"{status}; Ray reports the failed workers' node {', '.join(lost)} dead"
            loop.call_soon_threadsafe(self._set_rebuild_status, f"{failure}; rebuilding: {status}")

        try:
            self.core = await self._new_core(on_placement_wait)
        except Exception as error:
            self.dead_reason = f"engine rebuild failed: {short_reason(error)}"
            logger.exception("engine rebuild failed; the engine stays down")
            return
        self.loop_task = None
        freeze_startup_heap("scheduler actor")
        self.num_rebuilds += 1
        self.dead_reason = None
        logger.info("engine rebuilt (%d so far); serving again", self.num_rebuilds)

    def _set_rebuild_status(self, reason: str) -> None:
        if self.core is None and self._rebuilding():
            self.dead_reason = reason

    async def _watch_workers(self) -> None:
        """Ping the workers every WORKER_WATCH_PERIOD_S: a lost one starts the rebuild even when no step or health
        check would notice."""
        while True:
            await asyncio.sleep(WORKER_WATCH_PERIOD_S)
            core = self.core
            if core is None or self.draining or self.terminating or self._rebuilding():
                continue
            try:
                await self._check_workers(core)
            except EngineDeadError:
                pass  # logged, and the rebuild started
            except Exception:
                logger.exception("checking the model workers failed")

    async def _check_workers(self, core: EngineCore) -> None:
        """Raises EngineDeadError when a worker is gone; the first to find it starts the rebuild."""
        try:
            await core.check_health()
        except EngineDeadError as error:
            if self.core is core and not self._rebuilding():
                logger.error("health check found a dead worker: %s; rebuilding the engine", error)
                if self.loop_task is not None:
                    self.loop_task.cancel()
                self._start_rebuild(short_reason(error))
            raise

    async def _terminate(self) -> None:
        """Release the workers and placement group, then end this actor (its name frees for a new one)."""
        import ray

        self.terminating = True
        await self.shutdown()
        ray.kill(ray.get_runtime_context().current_actor)

    # Clients: attach, detach, and their leases.

    def _forget_client(self, client_id: str, failure: str | None = None) -> list[str]:
        """Drop a client and abort its requests (nobody reads them any more); returns their ids. With `failure`,
        a client that reads again after all learns its requests were ended."""
        request_ids = self.clients.forget(client_id, failure)
        if request_ids and self.core is not None:
            self.core.abort_request(request_ids)
        self.router.forget_client(client_id)
        return request_ids

    def _hung_up(self, client_id: str) -> None:
        """An ingress's output connection was closed by its end: its process is gone. Forget it now, not when its
        lease runs out: its requests free their blocks, and the live ingresses' last detach ends a shared engine at
        once. Were it alive after all, its next read learns its requests were ended."""
        if not self.clients.knows(client_id):
            return  # it detached first
        failure = "the ingress's output connection closed; its requests were aborted"
        request_ids = self._forget_client(client_id, failure)
        logger.warning("ingress %s hung up: aborted its %d requests", client_id, len(request_ids))

    async def attach(self, client_id: str) -> EngineInfo:
        """An ingress replica starts using this engine: engine_info plus the config this engine runs. Raises
        EngineDrainingError when this engine is ending (create a new one once it is gone)."""
        if self.terminating:
            raise EngineDrainingError("this engine is ending: its last ingress left")
        with self.clients.attaching(client_id):
            self._ensure_watcher()
            return await self.engine_info()

    async def detach(self, client_id: str) -> int:
        """An ingress replica stops (gracefully): forget it. The last one to leave a shared engine ends it.
        Returns how many ingresses remain."""
        self._forget_client(client_id)
        remaining = self.clients.num_clients
        if not remaining and self.clients.orphan_timeout_s is not None and not self.terminating:
            logger.info("the last ingress detached: this engine ends itself")
            self.terminating = True
            background_task(self._terminate())
        return remaining

    async def ping(self, client_id: str | None = None) -> bool:
        """Alive (even while rebuilding): what Ray Serve's replica health check asks; keeps the ingress attached."""
        if client_id is not None:
            self.clients.touch(client_id)
        return True

    # Requests in.

    async def engine_info(self) -> EngineInfo:
        """What an ingress needs to validate requests the way the engine will."""
        core = await self._started()
        return EngineInfo(
            max_model_len=core.model_info.max_model_len,
            vocab_size=core.model_info.vocab_size,
            num_kv_blocks=core.num_kv_blocks,
            block_size=self.config.cache.block_size,
            engine_config=self.config,
        )

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
        self.clients.touch(client_id)
        refusals = [self._admit(client_id, *request) for request in requests]
        self.new_work.set()
        return refusals

    def _admit(
        self, client_id: str, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> Exception | None:
        """Queue one request in the core; returns why it was refused, if it was."""
        if self.clients.take_early_abort(request_id):
            return None  # its abort overtook it: the client is gone already
        try:
            self.core.add_request(request_id, prompt_token_ids, params)
        except (ValueError, EngineOverloadedError) as refusal:
            return refusal
        self.router.clear_failure(client_id)
        self.clients.add_request(request_id, client_id)
        return None

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Stop requests and free their blocks. An async actor may run this before the add_request it follows:
        an unknown id is remembered for a while, and that request is dropped when it arrives."""
        core = await self._started()
        self.clients.remember_early_aborts(request_id for request_id in request_ids if not core.has_request(request_id))
        core.abort_request(request_ids)
        self.clients.forget_requests(request_ids)
        self.router.drop_ended_requests()

    async def stop_completion(self, request_id: str, index: int, stop_string: str) -> None:
        core = await self._started()
        core.stop_completion(request_id, index, stop_string)
        self.router.drop_completion(request_id, index)
        if not core.has_request(request_id):
            self.clients.forget_requests([request_id])

    # Outputs out.

    async def get_outputs(self, client_id: str) -> list[EngineOutput]:
        """Everything produced for this client's requests since its last call; waits briefly when empty."""
        await self.router.wait(client_id)
        return self.router.take(client_id)

    async def stream_outputs(self, client_id: str) -> AsyncIterator[list[EngineOutput]]:
        """get_outputs as a stream (call with num_returns="streaming"): one Ray message per batch instead of a call
        and its reply. Each batch holds everything new since the last; an empty one every OUTPUT_POLL_TIMEOUT_S
        while the client's requests produce nothing. Open it with `open_output_stream`: a reader that lags (its
        backpressure) holds the stream at its yield (no lease renewal meanwhile) while later steps pile up into one
        batch. Ends once this client has nothing in flight and nothing undelivered, or a newer stream of the same
        client started; raises what get_outputs raises."""
        async with contextlib.aclosing(self.router.stream(client_id)) as batches:
            async for batch in batches:
                yield batch

    async def open_output_channel(self) -> tuple[str, int, bytes]:
        """Where an ingress connects to read its outputs over a socket instead of `stream_outputs` (see
        executor.output_channel): (host, port, secret)."""
        if self.output_server_task is None:
            self.output_server_task = background_task(self.router.start_output_server())
        server = await asyncio.shield(self.output_server_task)
        host, port = server.sockets[0].getsockname()[:2]
        return host, port, self.router.output_secret

    # Health and state.

    async def check_health(self) -> None:
        """Raises while the engine is down or draining; a worker found dead here starts the rebuild."""
        if self.draining:
            raise EngineDrainingError("the server is shutting down")
        await self._check_workers(await self._started())

    # LoRA adapters (the ingress loads one into every engine replica of its model).

    async def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> dict:
        core = await self._started()
        return core.add_lora(name, path, base_model_name)

    async def remove_lora(self, name: str) -> bool:
        core = await self._started()
        return core.remove_lora(name)

    async def list_loras(self) -> list[dict]:
        core = await self._started()
        return core.list_loras()

    async def stats(self) -> EngineStats:
        core = await self._started()
        core_stats = core.stats()
        return EngineStats(
            **dataclasses.asdict(core_stats),
            num_steps=self.num_steps,
            num_rebuilds=self.num_rebuilds,
            num_clients=self.clients.num_clients,
            draining=self.draining,
            rss_bytes=process_rss_bytes(),
            # Per-request bookkeeping, all zero when idle (leak checks).
            num_tracked_requests=len(self.clients.request_owner) + core_stats.num_requests + self.router.num_held,
            num_undelivered_outputs=self.router.num_undelivered,
            num_early_aborts=len(self.clients.early_aborts),
        )

    async def metrics_text(self) -> bytes:
        """Prometheus exposition of this engine's metrics, gauges read now."""
        core = await self._started()
        return core.metrics_text()

    async def worker_handles(self) -> list[Any]:
        """The model worker actors, for operators (and fault-injection tests)."""
        core = await self._started()
        return core.worker_handles()

    async def topology(self) -> EngineTopology:
        """This actor's process and its model workers' (rank, pid): proof the layers really are separate actors."""
        core = await self._started()
        workers = await asyncio.gather(*[worker.identity.remote() for worker in core.worker_handles()])
        return EngineTopology(engine_pid=os.getpid(), workers=list(workers), placement_group_id=core.placement_group_id)

    # Graceful shutdown.

    async def drain(self) -> None:
        """Graceful shutdown, step 1: refuse new requests (and fail /health); the ones in flight go on."""
        self.draining = True

    async def fail_requests(self, reason: str) -> int:
        """Graceful shutdown, step 2 (grace over): end every request in flight with `reason`, free its blocks."""
        if self.core is None:
            return 0
        num_failed = self.core.abort_all_requests()
        self.router.fail(self.clients.release_all_requests(), reason)
        return num_failed

    async def shutdown(self) -> None:
        for task in (self.loop_task, self.watcher_task, self.stats_task, self.worker_watch_task):
            if task is not None:
                task.cancel()
        if self.output_server_task is not None and self.output_server_task.done():
            with contextlib.suppress(Exception):
                self.output_server_task.result().close()
        if self.core is not None:
            self.core.shutdown()
