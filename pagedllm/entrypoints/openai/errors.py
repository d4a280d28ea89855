"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with a matching status."""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowed", 413: "RequestTooLarge", 500: "InternalServerError",
          503: "ServiceUnavailableError"}


class OpenAIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


def error_body(message: str, status: int, param: str | None = None) -> dict:
    err_type = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(message: str, status: int = 400, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def param_of(message: str) -> str | None:
    """SamplingParams/Processor errors start with or name the field ("max_tokens must be ...")."""
    head = message.split(":", 1)[0].split(" ", 1)[0]
    return head if head.replace("_", "").replace(".", "").isalnum() and head.islower() else None
