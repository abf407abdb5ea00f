"""The OpenAI endpoints' work on validated request bodies: prompts and sampling parameters in, response models (or
a stream of chunk models) out. No HTTP here: the ingress turns what these return into responses."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from configs.app_config import ServeConfig
from configs.engine_config import EngineConfig
from configs.sampling_params import SamplingParams
from executor.engine_core import validate_prompt
from executor.outputs import EngineInfo
from model_executor.model_fetch import resolve_configured_model
from model_executor.model_info import generation_defaults as model_generation_defaults
from model_executor.structured_output import check_structured_outputs
from serve_app.chat_template import ChatTemplate, refuse_request_templates
from serve_app.logprobs import LogprobFormatter
from serve_app.protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    SamplingFields,
    StreamChunk,
    TokenizeRequest,
    TokenizeResponse,
    ToolCall,
    ToolCallFunction,
    Usage,
    now,
    random_id,
)
from serve_app.request_runner import Prompt, RequestRunner, Submission
from serve_app.tool_calling import ToolCallPlan, plan_tool_calls, requested_constraint, template_tools
from serve_app.tool_parsers import ParsedOutput, StreamDelta, ToolCallStream
from serve_app.validation import PromptLengthLimit, RequestError, check_model, parameter_named_in

logger = logging.getLogger(__name__)

# Characters of each of a request's tags (user, metadata) written to the log.
MAX_LOGGED_TAG_CHARS = 256


def generation_defaults(engine_config: EngineConfig) -> dict[str, Any]:
    """The sampling defaults a request inherits for the fields it omits (model.generation_config)."""
    model_dir = resolve_configured_model(engine_config.model, weights=False)
    return model_generation_defaults(model_dir, engine_config.model.generation_config)


@dataclass(slots=True)
class ChunkStream:
    """A streamed response: its chunks, and the submissions to release however the stream ends."""

    chunks: AsyncIterator[StreamChunk]
    submissions: list[Submission]


class OpenAIServing:
    def __init__(
        self,
        model_name: str,
        tokenizer: Any,
        engine_info: EngineInfo,
        settings: ServeConfig,
        runner: RequestRunner,
        tokenizer_thread: ThreadPoolExecutor,
    ):
        """`tokenizer_thread`: where tokenization (which releases the GIL) runs, so a long prompt does not stall
        every other stream on the event loop."""
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.engine_info = engine_info
        self.settings = settings
        self.runner = runner
        self.tokenizer_thread = tokenizer_thread
        # The LoRA adapters loaded in the engines (name -> what the engine lists), kept by the served model.
        self.adapters: dict[str, dict[str, Any]] = {}
        self.max_logprobs = engine_info.engine_config.model.max_logprobs
        self.generation_defaults = generation_defaults(engine_info.engine_config)
        self.length_limit = PromptLengthLimit.of(tokenizer, engine_info.max_model_len)
        self.chat_template = ChatTemplate(tokenizer, self.length_limit)
        self.logprobs = LogprobFormatter(tokenizer)

    def adapter_of(self, requested: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); any other name is a 404."""
        if requested is not None and requested in self.adapters:
            return requested
        check_model(requested, self.model_name)
        return None

    async def _tokenizing(self, function: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, function, *args)

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.adapter_of(body.model)
        refuse_request_templates(body)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError(400, "give exactly one of prompt or messages.", param="prompt")
        if body.messages is not None:
            token_ids = await self._tokenizing(
                self.chat_template.render,
                body.messages,
                body.add_generation_prompt,
                body.continue_final_message,
                template_tools(body.tools),
            )
        else:
            token_ids = await self._tokenizing(
                functools.partial(self.tokenizer.encode, add_special_tokens=body.add_special_tokens), body.prompt
            )
        return TokenizeResponse(count=len(token_ids), max_model_len=self.engine_info.max_model_len, tokens=token_ids)

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.adapter_of(body.model)
        vocab_size = self.engine_info.vocab_size
        bad = [token_id for token_id in body.tokens if not 0 <= token_id < vocab_size]
        if bad:
            raise RequestError(400, f"token id {bad[0]} is out of the vocabulary (size {vocab_size}).", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(body.tokens))

    async def _sampling_params(
        self,
        body: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        logprobs_param: str,
        tool_plan: ToolCallPlan | None = None,
    ) -> SamplingParams:
        """`logprobs_param`: the request's name for `logprobs`, for the error. The output constraint is the
        request's own, or the one its tool_choice implies (`tool_plan`), checked off the event loop (a schema's
        first check builds its grammar)."""
        settings = self.settings
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
        constraint = await self._tokenizing(self._output_constraint, body, tool_plan)
        try:
            params = body.sampling_params(max_tokens, logprobs, self.generation_defaults, constraint)
        except ValueError as error:
            raise RequestError(400, str(error), param=parameter_named_in(str(error))) from error
        try:
            params.verify_max_logprobs(self.max_logprobs, logprobs_param)
        except ValueError as error:
            raise RequestError(400, str(error), param=logprobs_param) from error
        return params

    @staticmethod
    def _output_constraint(body: SamplingFields, tool_plan: ToolCallPlan | None) -> Any:
        """The request's checked output constraint (a 400 naming its field if the grammar engine refuses it)."""
        constraint, field = requested_constraint(body)
        if tool_plan is not None and tool_plan.constraint is not None:
            constraint, field = tool_plan.constraint, "tools"
        if constraint is not None:
            try:
                check_structured_outputs(constraint)
            except ValueError as error:
                raise RequestError(400, f"{field}: {error}", param=field) from error
        return constraint

    def _max_tokens(self, explicit: int | None, fallback: int | None) -> tuple[int | None, bool]:
        """(max_tokens, whether the model's generation config chose it): the client's own, else the model's
        default, else `fallback`."""
        if explicit is None and "max_tokens" in self.generation_defaults:
            return self.generation_defaults["max_tokens"], True
        return (explicit if explicit is not None else fallback), False

    def _params_per_prompt(
        self, params: SamplingParams, prompts: list[Prompt], default_max_tokens: bool
    ) -> list[SamplingParams]:
        """One SamplingParams per prompt. A max_tokens the model's generation config chose (the client set none) is
        capped at the room each prompt leaves in the context, as vLLM does: nobody asked for more."""
        per_prompt = []
        for _, token_ids in prompts:
            room = self.engine_info.max_model_len - len(token_ids)
            if default_max_tokens and params.max_tokens is not None and 1 <= room < params.max_tokens:
                try:
                    per_prompt.append(dataclasses.replace(params, max_tokens=room))
                except ValueError as error:
                    raise RequestError(400, str(error), param=parameter_named_in(str(error))) from error
            else:
                per_prompt.append(params)
        return per_prompt

    async def _completion_prompts(self, prompt: Any) -> list[Prompt]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif not prompt:
            raise RequestError(400, "prompt must not be empty.", param="prompt")
        elif all(isinstance(item, int) for item in prompt):
            return [(None, list(prompt))]
        if all(isinstance(item, str) for item in prompt):
            for text in prompt:
                self.length_limit.check(len(text), "prompt")
            token_ids = await self._tokenizing(lambda: [self.tokenizer.encode(text) for text in prompt])
            return list(zip(prompt, token_ids))
        return [(None, list(item)) for item in prompt]

    def _validate_prompts(self, prompts: list[Prompt], params_per_prompt: list[SamplingParams]) -> None:
        """The engine's own checks, here, so a bad request is a 400 before anything reaches the scheduler."""
        for (_, token_ids), params in zip(prompts, params_per_prompt):
            try:
                validate_prompt(token_ids, params, self.engine_info.max_model_len, self.engine_info.vocab_size)
            except ValueError as error:
                raise RequestError(400, str(error), param=parameter_named_in(str(error)) or "prompt") from error

    def _echo_text(self, prompt: Prompt) -> str:
        text, token_ids = prompt
        return text if text is not None else self.tokenizer.decode(token_ids)

    async def complete(self, body: CompletionRequest) -> CompletionResponse | ChunkStream:
        lora_name = self.adapter_of(body.model)
        if body.echo and body.logprobs is not None:
            raise RequestError(400, "echo together with logprobs is not supported.", param="echo")
        # Without a model default: left out is OpenAI's 16 (body.max_tokens), null is up to the context.
        max_tokens, default_max_tokens = self._max_tokens(body.explicit_max_tokens(), body.max_tokens)
        params = await self._sampling_params(body, max_tokens, body.logprobs, "logprobs")
        params.lora_name = lora_name
        prompts = await self._completion_prompts(body.prompt)
        params_per_prompt = self._params_per_prompt(params, prompts, default_max_tokens)
        self._validate_prompts(prompts, params_per_prompt)
        completion_id = random_id("cmpl")
        created = now()
        log_request_tags(completion_id, body)
        submissions = await self.runner.submit(completion_id, prompts, params_per_prompt)
        if body.stream:
            chunks = self._completion_chunks(completion_id, created, prompts, submissions, params, body)
            return ChunkStream(chunks, submissions)
        final = await self.runner.run_to_end(submissions, params)
        choices = []
        num_completion_tokens = 0
        for prompt_index in range(len(prompts)):
            for completion in final[prompt_index].output.outputs:
                num_completion_tokens += len(completion.token_ids)
                prefix = self._echo_text(prompts[prompt_index]) if body.echo else ""
                logprobs = None if completion.logprobs is None else self.logprobs.completion(completion.logprobs)
                choices.append(
                    CompletionChoice(
                        index=prompt_index * params.n + completion.index,
                        text=prefix + completion.text,
                        logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                )
        num_prompt_tokens = sum(len(token_ids) for _, token_ids in prompts)
        return CompletionResponse(
            id=completion_id,
            created=created,
            model=params.lora_name or self.model_name,
            choices=choices,
            usage=Usage.of(num_prompt_tokens, num_completion_tokens),
        )

    async def _completion_chunks(
        self,
        completion_id: str,
        created: int,
        prompts: list[Prompt],
        submissions: list[Submission],
        params: SamplingParams,
        body: CompletionRequest,
    ) -> AsyncIterator[CompletionStreamResponse]:
        chunk = functools.partial(
            CompletionStreamResponse, id=completion_id, created=created, model=params.lora_name or self.model_name
        )
        if body.echo:
            for prompt_index, prompt in enumerate(prompts):
                for index in range(params.n):
                    echoed = CompletionChoice(index=prompt_index * params.n + index, text=self._echo_text(prompt))
                    yield chunk(choices=[echoed])
        num_completion_tokens = 0
        text_offsets: dict[int, int] = {}
        async for prompt_index, state in self.runner.merged(submissions, params):
            for delta in state.deltas:
                num_completion_tokens += len(delta.token_ids)
                if not delta.text and delta.finish_reason is None:
                    continue
                index = prompt_index * params.n + delta.index
                logprobs = None
                if params.logprobs is not None:
                    logprobs = self.logprobs.completion(delta.logprobs, text_offsets.get(index, 0))
                    text_offsets[index] = text_offsets.get(index, 0) + len(delta.text)
                choice = CompletionChoice(
                    index=index,
                    text=delta.text,
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                )
                yield chunk(choices=[choice])
        if body.stream_options and body.stream_options.include_usage:
            num_prompt_tokens = sum(len(token_ids) for _, token_ids in prompts)
            yield chunk(choices=[], usage=Usage.of(num_prompt_tokens, num_completion_tokens))

    async def chat(self, body: ChatCompletionRequest) -> ChatCompletionResponse | ChunkStream:
        lora_name = self.adapter_of(body.model)
        refuse_request_templates(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs")
        settings = self.settings
        tool_plan = plan_tool_calls(body, settings.tool_call_parser, settings.enable_auto_tool_choice)
        prompt_token_ids = await self._tokenizing(
            self.chat_template.render,
            body.messages,
            body.add_generation_prompt,
            body.continue_final_message,
            template_tools(body.tools),
        )
        max_tokens, default_max_tokens = self._max_tokens(body.explicit_max_tokens(), None)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = await self._sampling_params(body, max_tokens, logprobs, "top_logprobs", tool_plan)
        params.lora_name = lora_name
        prompts: list[Prompt] = [(None, prompt_token_ids)]
        params_per_prompt = self._params_per_prompt(params, prompts, default_max_tokens)
        self._validate_prompts(prompts, params_per_prompt)
        completion_id = random_id("chatcmpl")
        created = now()
        log_request_tags(completion_id, body)
        submissions = await self.runner.submit(completion_id, prompts, params_per_prompt)
        if body.stream:
            chunks = self._chat_chunks(
                completion_id, created, len(prompt_token_ids), submissions, params, body, tool_plan
            )
            return ChunkStream(chunks, submissions)
        state = (await self.runner.run_to_end(submissions, params))[0]
        choices = []
        for completion in state.output.outputs:
            message, finish_reason = assistant_message(completion.text, completion.finish_reason, tool_plan)
            choices.append(
                ChatCompletionChoice(
                    index=completion.index,
                    message=message,
                    logprobs=None if completion.logprobs is None else self.logprobs.chat(completion.logprobs),
                    finish_reason=finish_reason,
                    stop_reason=completion.stop_reason,
                )
            )
        num_completion_tokens = sum(len(completion.token_ids) for completion in state.output.outputs)
        return ChatCompletionResponse(
            id=completion_id,
            created=created,
            model=params.lora_name or self.model_name,
            choices=choices,
            usage=Usage.of(len(prompt_token_ids), num_completion_tokens),
        )

    async def _chat_chunks(
        self,
        completion_id: str,
        created: int,
        num_prompt_tokens: int,
        submissions: list[Submission],
        params: SamplingParams,
        body: ChatCompletionRequest,
        tool_plan: ToolCallPlan,
    ) -> AsyncIterator[ChatCompletionStreamResponse]:
        chunk = functools.partial(
            ChatCompletionStreamResponse, id=completion_id, created=created, model=params.lora_name or self.model_name
        )
        for index in range(params.n):
            opening = ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
            yield chunk(choices=[opening])
        num_completion_tokens = 0
        # Per completion: the tool-call parser's state and the text so far (the parser reads the whole of it).
        tool_streams = {index: StreamedToolCalls(tool_plan) for index in range(params.n)} if tool_plan.parser else {}
        async for _, state in self.runner.merged(submissions, params):
            for delta in state.deltas:
                num_completion_tokens += len(delta.token_ids)
                logprobs = self.logprobs.chat(delta.logprobs) if params.logprobs is not None else None
                finish_reason = delta.finish_reason
                if tool_plan.parser is not None:
                    streamed = tool_streams[delta.index]
                    message = streamed.feed(delta.text, finish_reason is not None)
                    if finish_reason == "stop" and streamed.called_tools:
                        finish_reason = "tool_calls"
                else:
                    message = DeltaMessage(content=delta.text) if delta.text else None
                # Logprobs asked for: every delta is sent, even one with no text.
                if message is not None or logprobs is not None:
                    yield chunk(
                        choices=[
                            ChatCompletionStreamChoice(
                                index=delta.index, delta=message or DeltaMessage(content=""), logprobs=logprobs
                            )
                        ]
                    )
                if finish_reason is not None:
                    ending = ChatCompletionStreamChoice(
                        index=delta.index, delta=DeltaMessage(), finish_reason=finish_reason
                    )
                    yield chunk(choices=[ending])
        if body.stream_options and body.stream_options.include_usage:
            yield chunk(choices=[], usage=Usage.of(num_prompt_tokens, num_completion_tokens))


def log_request_tags(request_id: str, body: SamplingFields) -> None:
    """The caller's own tags for a request (OpenAI's user, safety_identifier, metadata), in the server's log, each
    cut to MAX_LOGGED_TAG_CHARS (a client can send megabytes in `user`)."""
    tags = {name: getattr(body, name, None) for name in ("user", "safety_identifier", "metadata")}
    shown = {name: _shortened(str(value)) for name, value in tags.items() if value is not None}
    if shown:
        logger.info("request %s: %s", request_id, shown)


def _shortened(text: str) -> str:
    if len(text) <= MAX_LOGGED_TAG_CHARS:
        return text
    return f"{text[:MAX_LOGGED_TAG_CHARS]}... ({len(text)} characters)"


def assistant_message(text: str, finish_reason: str | None, plan: ToolCallPlan) -> tuple[AssistantMessage, str | None]:
    """The reply message of a finished completion, its tool calls read from the text when tools may be called."""
    if plan.parser is None:
        return AssistantMessage(content=text), finish_reason
    parsed: ParsedOutput = plan.parser.parse(text)
    calls = parsed.tool_calls[: plan.max_calls] if plan.max_calls is not None else parsed.tool_calls
    if not calls:
        return AssistantMessage(content=text), finish_reason
    tool_calls = [
        ToolCall(id=call.id, function=ToolCallFunction(name=call.name, arguments=call.arguments)) for call in calls
    ]
    return (
        AssistantMessage(content=parsed.content, tool_calls=tool_calls),
        "tool_calls" if finish_reason == "stop" else finish_reason,
    )


class StreamedToolCalls:
    """One streamed completion read by its tool-call parser: each text delta in, the message delta to send out."""

    def __init__(self, plan: ToolCallPlan):
        self.stream: ToolCallStream = plan.parser.stream()
        self.max_calls = plan.max_calls
        self.text = ""
        self.called_tools = False

    def feed(self, text: str, final: bool) -> DeltaMessage | None:
        self.text += text
        parsed: StreamDelta = self.stream.feed(self.text, final)
        calls = [call for call in parsed.tool_calls if self.max_calls is None or call.index < self.max_calls]
        self.called_tools = self.called_tools or bool(calls)
        if not parsed.content and not calls:
            return None
        delta_calls = [
            DeltaToolCall(
                index=call.index,
                id=call.id,
                type="function" if call.id is not None else None,
                function=DeltaFunction(name=call.name, arguments=call.arguments),
            )
            for call in calls
        ]
        return DeltaMessage(content=parsed.content or None, tool_calls=delta_calls or None)
