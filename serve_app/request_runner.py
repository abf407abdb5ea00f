"""Runs one HTTP request's prompts on the engine replicas: queues each in a replica, follows its detokenized
state, and releases whatever is left in an engine however the response ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from configs.sampling_params import SamplingParams
from executor.errors import EngineDeadError
from executor.output_processor import OutputProcessor, RequestState
from serve_app.engine_client import EngineClient
from serve_app.engine_router import EngineRouter
from serve_app.validation import RequestError

# A prompt as the ingress keeps it: its text when the client sent text (for echo), and its token ids.
Prompt = tuple[str | None, list[int]]


@dataclass(slots=True)
class Submission:
    """A prompt queued in an engine replica, with the detokenizing state that follows it."""

    request_id: str
    prompt_index: int
    client: EngineClient
    state: RequestState


class RequestRunner:
    def __init__(self, router: EngineRouter, processor: OutputProcessor, timeout_s: float | None):
        """`timeout_s`: the end-to-end limit of one request (None: none)."""
        self.router = router
        self.processor = processor
        self.timeout_s = timeout_s

    async def submit(
        self, base_id: str, prompts: list[Prompt], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Submission]:
        """Queue every prompt in an engine before any response starts: refusals stay plain HTTP errors. `params`:
        one for every prompt, or one per prompt (they may differ in max_tokens only)."""
        params_per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        submissions: list[Submission] = []
        try:
            for prompt_index, ((prompt, token_ids), prompt_params) in enumerate(zip(prompts, params_per_prompt)):
                request_id = base_id if len(prompts) == 1 else f"{base_id}-{prompt_index}"
                client = await self.router.pick(token_ids)
                state = self.processor.add_request(request_id, prompt, token_ids, prompt_params)
                submissions.append(Submission(request_id, prompt_index, client, state))
                try:
                    await client.submit(request_id, token_ids, prompt_params)
                except EngineDeadError:
                    # That replica is down (rebuilding, restarting): another one, if any is up, takes the prompt.
                    retry = await self.router.pick(token_ids)
                    if retry is client:
                        raise
                    submissions[-1] = Submission(request_id, prompt_index, retry, state)
                    await retry.submit(request_id, token_ids, prompt_params)
        except BaseException as error:
            self.release(submissions)
            if isinstance(error, ValueError):
                raise RequestError(400, str(error)) from error
            raise
        return submissions

    def release(self, submissions: list[Submission]) -> None:
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

    async def merged(
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

    async def run_to_end(self, submissions: list[Submission], params: SamplingParams) -> dict[int, RequestState]:
        """Every prompt's final state (non-streamed responses), within the time limit."""
        final: dict[int, RequestState] = {}
        try:
            async with self.deadline():
                async for prompt_index, state in self.merged(submissions, params):
                    final[prompt_index] = state
        except TimeoutError as error:
            raise self.timeout_error() from error
        finally:
            # Also when cancelled (client gone) before a follower started: nothing may stay queued unread.
            self.release(submissions)
        return final

    def deadline(self) -> asyncio.Timeout:
        return asyncio.timeout(self.timeout_s)

    def timeout_error(self) -> RequestError:
        return RequestError(
            504, f"the request did not finish within {self.timeout_s} s and was aborted.", "TimeoutError"
        )
