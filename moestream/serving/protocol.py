"""The OpenAI-compatible request bodies (pydantic) and the JSON the server answers with: errors in
OpenAI's shape, completion and chat responses and their streamed chunks. Unknown body fields are
ignored (pydantic's default); a switch takes only true or false. No engine, no routes."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field, StrictBool

from moestream.serving.sampling import SamplingParams


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Body(BaseModel):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # an extension of OpenAI's API, as in vLLM (0: all tokens)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False  # "yes" or 1 is refused (400), as vLLM does
    n: int = 1
    ignore_eos: StrictBool = False  # an extension, as in vLLM: generate max_tokens whatever the model ends with
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None  # refused when asked for (see `refused`)
    top_logprobs: int | None = None

    def refused(self) -> tuple[str, str] | None:
        """(parameter, why) of an option this server does not support, or None."""
        if self.n != 1:
            return "n", "only n=1 is supported"
        if self.logprobs not in (None, False, 0) or self.top_logprobs:
            return "top_logprobs" if self.top_logprobs else "logprobs", "logprobs are not supported by this server"
        return None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Raises SamplingError on values out of range."""
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=self.stop or (), ignore_eos=self.ignore_eos)


class CompletionBody(_Body):
    prompt: str | list[int]


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None


def error_json(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _envelope(rid: str, model: str, chat: bool, choices: list[dict], streamed: bool = True) -> dict:
    obj = ("chat.completion.chunk" if streamed else "chat.completion") if chat else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices}


def _choice(content: dict, finish_reason: str | None) -> dict:
    return {"index": 0} | content | {"logprobs": None, "finish_reason": finish_reason}


def _usage(num_prompt_tokens: int, num_tokens: int) -> dict:
    return {"usage": {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_tokens,
                      "total_tokens": num_prompt_tokens + num_tokens}}


def chunk(rid: str, model: str, chat: bool, text: str, finish_reason: str | None, first: bool) -> dict:
    """One streamed chunk in OpenAI's format."""
    delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
    return _envelope(rid, model, chat, [_choice({"delta": delta} if chat else {"text": text}, finish_reason)])


def usage_chunk(rid: str, model: str, chat: bool, num_prompt_tokens: int, num_tokens: int) -> dict:
    """The last streamed chunk when stream_options.include_usage: no choices, the request's usage."""
    return _envelope(rid, model, chat, []) | _usage(num_prompt_tokens, num_tokens)


def response(rid: str, model: str, chat: bool, text: str, finish_reason: str,
             num_prompt_tokens: int, num_tokens: int) -> dict:
    """The whole answer of a non-streamed request, with its token usage."""
    content = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    choices = [_choice(content, finish_reason)]
    return _envelope(rid, model, chat, choices, streamed=False) | _usage(num_prompt_tokens, num_tokens)
