"""One line of an OpenAI batch file -> a `Request` the backends run, or a `RequestError`.

The API has checked each line's shape (`custom_id`, `method`, `url`, a body with `model`);
what is checked here is what only the model can tell, and the values a backend would
otherwise take wrongly: the messages (through the model's chat template), the prompt or
input, the sampling parameters, and that prompt plus completion fit the model's context.
A line that fails becomes that request's error row (`RequestError`, with OpenAI's `param`
and `code`), and the batch goes on.

Defaults where a body says nothing: `max_tokens` 16 (the tiny models write noise, and a
batch of long completions is a choice to make, not a default), `temperature` 1 and
`top_p` 1 (OpenAI's), `n` 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS)
DEFAULT_MAX_TOKENS = 16
TEMPERATURE_MAX = 2.0     # OpenAI's range for temperature: [0, 2]
N_MAX = 128               # OpenAI's limit on choices per request
STOP_MAX = 4              # OpenAI's limit on stop sequences
ENCODING_FORMATS = ("float", "base64")


class RequestError(ValueError):
    """Raised when one request cannot be run: its error row names the `param` and a `code`."""

    def __init__(self, message: str, *, param: str | None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class Sampling:
    """What a completion is drawn with; requests with equal `Sampling` may share a batch."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Request:
    """A checked request: its prompts as token ids (one for chat, one or more otherwise)."""

    custom_id: Any
    prompts: tuple[tuple[int, ...], ...]
    sampling: Sampling
    encoding_format: str = "float"
    dimensions: int | None = None


@dataclass(frozen=True)
class Choice:
    """One generated completion."""

    text: str
    completion_tokens: int
    finish_reason: str    # "stop" (end of turn or a stop string) or "length" (max_tokens)


class Prompter:
    """Turns a body into token ids with the model's tokenizer (a transformers tokenizer)."""

    def __init__(self, tokenizer: Any, context_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.context_tokens = context_tokens
        self._vocab_size = len(tokenizer)

    def parse(self, line: str, endpoint: str) -> Request:
        """The request on `line` (JSON), or RequestError; the custom_id is `custom_id(line)`."""
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise RequestError(f"the line is not JSON: {exc}", param=None,
                               code="invalid_json") from exc
        body = obj.get("body") if isinstance(obj, dict) else None
        if not isinstance(body, dict):
            raise RequestError("the line has no body object", param="body")
        if endpoint == EMBEDDINGS:
            return self._embedding(obj.get("custom_id"), body)
        prompts: tuple[tuple[int, ...], ...]
        if endpoint == CHAT:
            prompts = (self._chat(body.get("messages")),)
            where = "messages"
        else:
            prompts = self._token_lists(body.get("prompt"), "prompt")
            where = "prompt"
        sampling = _sampling(body)
        longest = max(len(p) for p in prompts)
        if longest + sampling.max_tokens > self.context_tokens:
            raise RequestError(
                f"This model's maximum context length is {self.context_tokens} tokens. "
                f"However, you requested {longest + sampling.max_tokens} tokens ({longest} in "
                f"the {where}, {sampling.max_tokens} in the completion). Please reduce the "
                f"length of the {where} or completion.", param=where,
                code="context_length_exceeded")
        return Request(obj.get("custom_id"), prompts, sampling)

    def _embedding(self, custom_id: Any, body: dict[str, Any]) -> Request:
        prompts = self._token_lists(body.get("input"), "input")
        longest = max(len(p) for p in prompts)
        if longest > self.context_tokens:
            raise RequestError(
                f"This model's maximum context length is {self.context_tokens} tokens, "
                f"however you requested {longest} tokens in the input. Please reduce the "
                "length of the input.", param="input", code="context_length_exceeded")
        fmt = body.get("encoding_format") or "float"
        if fmt not in ENCODING_FORMATS:
            raise RequestError(f"encoding_format must be one of {list(ENCODING_FORMATS)}",
                               param="encoding_format")
        dims = body.get("dimensions")
        if dims is not None and not _whole(dims, 1):
            raise RequestError("dimensions must be a whole number of at least 1",
                               param="dimensions")
        return Request(custom_id, prompts, Sampling(), encoding_format=fmt, dimensions=dims)

    def _chat(self, messages: Any) -> tuple[int, ...]:
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list of messages",
                               param="messages")
        plain = [_message(m, i) for i, m in enumerate(messages)]
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise RequestError("this model has no chat template: use /v1/completions",
                               param="messages")
        try:
            text = self.tokenizer.apply_chat_template(plain, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception as exc:  # the template refuses these messages
            raise RequestError(f"the model's chat template refused the messages: {exc}",
                               param="messages") from exc
        return self._encode(text, "messages")

    def _token_lists(self, value: Any, param: str) -> tuple[tuple[int, ...], ...]:
        """A string, a list of strings, a list of token ids, or a list of those lists."""
        if isinstance(value, str):
            return (self._encode(value, param),)
        if isinstance(value, list) and value:
            if all(isinstance(v, str) for v in value):
                return tuple(self._encode(v, param) for v in value)
            lists = value if all(isinstance(v, list) for v in value) else [value]
            if all(v and all(self._token(t) for t in v) for v in lists):
                return tuple(tuple(v) for v in lists)
        raise RequestError(f"{param} must be a non-empty string, a list of strings, or token "
                           f"ids (each below the vocabulary's {self._vocab_size})", param=param)

    def _token(self, value: Any) -> bool:
        return _whole(value, 0) and value < self._vocab_size

    def _encode(self, text: str, param: str) -> tuple[int, ...]:
        ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise RequestError(f"{param} must not be empty", param=param)
        return ids


def custom_id(line: str) -> Any:
    """The line's custom_id, or None when the line is not a JSON object that has one."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj.get("custom_id") if isinstance(obj, dict) else None


def _message(message: Any, index: int) -> dict[str, str]:
    """A message with its content as one string (text parts joined)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"{where} must be an object with a role", param=where)
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise RequestError(f"{where}.content: only text parts are supported",
                               param=f"{where}.content")
        content = "".join(p["text"] for p in content)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string or a list of text parts",
                           param=f"{where}.content")
    return {"role": message["role"], "content": content}


def _sampling(body: dict[str, Any]) -> Sampling:
    """The sampling parameters of a chat or completions body, checked."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    elif not _whole(max_tokens, 1):
        param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        raise RequestError(f"{param} must be a whole number of at least 1", param=param)
    temperature = _number(body, "temperature", 1.0, 0.0, TEMPERATURE_MAX)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise RequestError("top_p must be greater than 0", param="top_p")
    seed = body.get("seed")
    if seed is not None and not _whole(seed, -(2 ** 63)):
        raise RequestError("seed must be a whole number", param="seed")
    n = body.get("n")
    if n is None:
        n = 1
    elif not _whole(n, 1) or n > N_MAX:
        raise RequestError(f"n must be a whole number from 1 to {N_MAX}", param="n")
    return Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                    n=n, stop=_stop(body.get("stop")))


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > STOP_MAX
            or not all(isinstance(s, str) and s for s in stops)):
        raise RequestError(f"stop must be a non-empty string or a list of up to {STOP_MAX}",
                           param="stop")
    return tuple(stops)


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise RequestError(f"{name} must be a number from {low:g} to {high:g}", param=name)
    return float(value)


def _whole(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low
