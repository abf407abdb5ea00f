"""The ingress side of the scheduler actor: one output pump per ingress replica, one queue per request."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from typing import Any

import ray

from configs.sampling_params import SamplingParams
from executor.engine_core import EngineOutput
from executor.executors import EngineDeadError, EngineOverloadedError

logger = logging.getLogger(__name__)


def unwrap_ray_error(error: BaseException) -> BaseException:
    """A ValueError raised in the actor arrives wrapped; hand the original to the HTTP layer."""
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = error.as_instanceof_cause()
        if isinstance(cause, ValueError | EngineDeadError | EngineOverloadedError):
            return cause
        return EngineDeadError(str(error))
    if isinstance(error, ray.exceptions.RayActorError):
        return EngineDeadError(f"the engine actor died: {error}")
    return error


class EngineClient:
    def __init__(self, engine: Any):
        self.engine = engine
        self.client_id = uuid.uuid4().hex
        self.queues: dict[str, asyncio.Queue] = {}
        self.pump_task: asyncio.Task | None = None
        self.engine_error: BaseException | None = None

    @property
    def num_in_flight(self) -> int:
        return len(self.queues)

    def _ensure_pump(self) -> None:
        if self.pump_task is None or self.pump_task.done():
            self.engine_error = None
            self.pump_task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        """One Ray call brings every new token of every request of this replica."""
        while self.queues:
            try:
                outputs: list[EngineOutput] = await self.engine.get_outputs.remote(self.client_id)
            except Exception as error:
                self.engine_error = unwrap_ray_error(error)
                logger.error("engine unreachable: %s", self.engine_error)
                for queue in self.queues.values():
                    queue.put_nowait(self.engine_error)
                return
            by_request: dict[str, list[EngineOutput]] = defaultdict(list)
            for output in outputs:
                by_request[output.request_id].append(output)
            for request_id, request_outputs in by_request.items():
                queue = self.queues.get(request_id)
                if queue is not None:
                    queue.put_nowait(request_outputs)

    async def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Queue the request in the engine. Raises ValueError (bad input), EngineOverloadedError (queue full) or
        EngineDeadError (engine down) before anything is streamed, so the client still gets a plain HTTP error."""
        self.queues[request_id] = asyncio.Queue()
        try:
            await self.engine.add_request.remote(self.client_id, request_id, list(prompt_token_ids), params)
        except Exception as error:
            del self.queues[request_id]
            raise unwrap_ray_error(error) from None
        self._ensure_pump()

    async def outputs(self, request_id: str, num_completions: int) -> AsyncIterator[list[EngineOutput]]:
        """Yields a submitted request's outputs per engine step until every completion finished.

        Leaving early (client gone, stop string, timeout) aborts the request in the engine, which frees its blocks.
        """
        queue = self.queues[request_id]
        num_unfinished = num_completions
        try:
            while num_unfinished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                num_unfinished -= sum(1 for output in item if output.finish_reason is not None)
                yield item
        finally:
            self.queues.pop(request_id, None)
            if num_unfinished:
                await self._abort_quietly(request_id)

    async def cancel(self, request_id: str) -> None:
        """Drop a submitted request nobody will read."""
        if self.queues.pop(request_id, None) is not None:
            await self._abort_quietly(request_id)

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await asyncio.shield(self.engine.abort.remote([request_id]))
        except Exception as error:
            logger.warning("abort of %s failed: %s", request_id, error)

    async def stop_completion(self, request_id: str, index: int, stop_string: str) -> None:
        await self.engine.stop_completion.remote(request_id, index, stop_string)
