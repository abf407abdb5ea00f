"""Chat messages -> prompt token ids through the model's own chat template, with the senders' text kept as text."""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from pydantic import BaseModel

from serve_app.protocol import ChatMessage
from serve_app.tool_calling import template_messages
from serve_app.validation import PromptLengthLimit, RequestError


def message_text(message: ChatMessage) -> str:
    """Chat content may be a string or a list of text parts."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for part in message.content:
        if part.get("type") != "text":
            raise ValueError(f"messages content part of type {part.get('type')!r} is not supported (text only).")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def refuse_request_templates(body: BaseModel) -> None:
    """Only the model's own chat template renders prompts: one from the request could emit any control token."""
    for refused in ("chat_template", "chat_template_kwargs"):
        if (body.model_extra or {}).get(refused) is not None:
            raise RequestError(400, f"{refused} from the request is not accepted.", param=refused)


class ChatTemplate:
    """Renders messages with the tokenizer's chat template. Special-token text inside a message (`<|im_end|>` ...)
    is the sender's text, not a control token: it is tokenized as plain text."""

    def __init__(self, tokenizer: Any, length_limit: PromptLengthLimit):
        self.tokenizer = tokenizer
        self.length_limit = length_limit
        special = sorted(
            {token.content for token in tokenizer.added_tokens_decoder.values() if token.special},
            key=len,
            reverse=True,
        )
        self.special_token_text = re.compile("|".join(map(re.escape, special))) if special else None

    def render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The prompt's token ids. Each special-token string in a message is swapped for a placeholder before
        rendering, and the placeholder tokenized as the plain text it stands for. `tools`: OpenAI's tool
        definitions, passed to the template as `tools`."""
        if not messages:
            raise RequestError(400, "messages must not be empty.", param="messages")
        literals: dict[str, str] = {}
        nonce = secrets.token_hex(8)

        def hide_special_text(text: str) -> str:
            def placeholder(match: re.Match) -> str:
                key = f"\ue000{nonce}:{len(literals)}\ue001"
                literals[key] = match.group(0)
                return key

            return text if self.special_token_text is None else self.special_token_text.sub(placeholder, text)

        try:
            contents = [message_text(message) for message in messages]
            self.length_limit.check(sum(map(len, contents)), "messages")
            conversation = template_messages(messages, [hide_special_text(content) for content in contents])
            self._refuse_special_text_in_tools(messages, tools)
            text = self.tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
            )
        except ValueError as error:
            raise RequestError(400, str(error), param="messages") from error
        # The template's own text holds the special tokens the model expects: those parse as control tokens.
        if not literals:
            return self.tokenizer.encode(text, add_special_tokens=False)
        token_ids: list[int] = []
        for piece in re.split(f"(\ue000{nonce}:\\d+\ue001)", text):
            if piece in literals:
                token_ids += self.plain_text_token_ids(literals[piece])
            elif piece:
                token_ids += self.tokenizer.encode(piece, add_special_tokens=False)
        return token_ids

    def _refuse_special_text_in_tools(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None) -> None:
        """Tool definitions and earlier calls reach the template as JSON values, where no placeholder can stand in
        for a special-token string: one there is refused rather than read as a control token."""
        if self.special_token_text is None:
            return
        if tools and self.special_token_text.search(json.dumps(tools, ensure_ascii=False)):
            raise RequestError(400, "tools must not contain special-token text.", param="tools")
        for index, message in enumerate(messages):
            for call in message.tool_calls or []:
                if self.special_token_text.search(call.function.name + call.function.arguments):
                    raise RequestError(
                        400,
                        f"messages.{index}.tool_calls must not contain special-token text.",
                        param=f"messages.{index}.tool_calls",
                    )

    def plain_text_token_ids(self, text: str) -> list[int]:
        """Token ids of `text` with every special-token string in it spelled out as ordinary text."""
        token_ids: list[int] = []
        while text:
            match = self.special_token_text.search(text)
            if match is None:
                return token_ids + self.tokenizer.encode(text, add_special_tokens=False)
            # Cut after the marker's first character: what is left no longer matches it.
            token_ids += self.tokenizer.encode(text[: match.start() + 1], add_special_tokens=False)
            text = text[match.start() + 1 :]
        return token_ids
