"""The error a request gets: an HTTP status and OpenAI's error body."""

from __future__ import annotations


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` and the OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None,
        type: str = "invalid_request_error",
        *,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code

    def to_json(self) -> dict[str, dict[str, str | None]]:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
