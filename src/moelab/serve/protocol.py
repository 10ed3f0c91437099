"""OpenAI-compatible request bodies and error objects (``/v1/completions``, ``/v1/chat``).

Shapes follow the OpenAI API reference. Types are checked by pydantic (a wrongly typed or
missing field answers 422); value ranges are checked here with OpenAI's wording of the
parameter (answers 400). Unknown fields are ignored, as OpenAI-compatible servers do, except
that features this server does not implement (``logprobs``, ``echo``, ``best_of`` > n,
tools) are refused with 400 rather than silently dropped.

Extensions (pass them through the openai client's ``extra_body``): ``top_k`` (int) and
``routing`` (bool): return, per generated token, the experts each MoE layer chose.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from moelab.serve.sampling import check_sampling
from moelab.utils.fields import check_seed


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: StrictInt | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    routing: StrictBool = False
    logprobs: Any = None
    user: str | None = None

    def check_values(self, max_n: int) -> None:
        """Raise :class:`APIError` 400 naming the parameter for out-of-range values."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise APIError(
                400, f"max_tokens: must be >= 1, got {self.max_tokens}", param="max_tokens"
            )
        try:  # the engine's own rules (float32 ranges, 64-bit seeds), answered as 400s
            check_sampling(self.temperature, self.top_k, self.top_p)
            if self.seed is not None:
                check_seed(self.seed)
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(":")[0]) from None
        if not 1 <= self.n <= max_n:
            raise APIError(400, f"n: must be in [1, {max_n}], got {self.n}", param="n")
        if self.logprobs not in (None, False):
            raise APIError(400, "logprobs: not supported by this server", param="logprobs")
        stops = self.stop_list()
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop: up to 4 non-empty strings", param="stop")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings (one choice set
    each), a list of token ids, or a list of such lists."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    best_of: StrictInt | None = None

    def check_values(self, max_n: int) -> None:
        super().check_values(max_n)
        if self.echo:
            raise APIError(400, "echo: not supported by this server", param="echo")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of: only best_of == n is supported", param="best_of")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message text (text parts of a content list joined; other parts refused)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    400, "messages: only text content parts are supported", param="messages"
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    tools: Any = None

    def check_values(self, max_n: int) -> None:
        super().check_values(max_n)
        if self.tools:
            raise APIError(400, "tools: not supported by this server", param="tools")
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 1:
                raise APIError(
                    400,
                    f"max_completion_tokens: must be >= 1, got {self.max_completion_tokens}",
                    param="max_completion_tokens",
                )
            self.max_tokens = self.max_completion_tokens
