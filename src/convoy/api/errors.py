"""OpenAI error objects and the handlers that turn every failure into one.

Every error the server answers, including FastAPI's schema validation, malformed JSON, unknown
routes and unexpected exceptions, has the body `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from convoy.api.protocol_common import ErrorInfo, ErrorResponse
from convoy.engine.errors import EngineError, EngineStepError, EngineUnavailableError
from convoy.engine.tokenizer import TemplateError
from convoy.sampling_params import SamplingParamsError
from convoy.structured.params import StructuredOutputsError

logger = logging.getLogger(__name__)

_TYPES = {
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
_CODES = {401: "invalid_api_key", 404: "not_found", 413: "request_too_large"}


class APIError(Exception):
    """An error answered with an HTTP status and an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,  # e.g. Retry-After on a 429
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else _CODES.get(status)
        self.headers = headers

    def to_response(self) -> ErrorResponse:
        err_type = _TYPES.get(self.status, "invalid_request_error")
        info = ErrorInfo(message=self.message, type=err_type, param=self.param, code=self.code)
        return ErrorResponse(error=info)


def disk_full(what: str, e: BaseException, param: str | None) -> APIError:
    """507 for a request that needed room on the data disk and found none."""
    message = f"the server's data disk is full: {what} ({e})"
    return APIError(507, message, param=param, code="insufficient_storage")


class BodyTooLarge(StarletteHTTPException):
    """Raised while reading a request body past the size limit.

    NOTE: an HTTPException on purpose: FastAPI re-raises those from body parsing, while any other
    exception there becomes a generic 400.
    """

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than the limit of {limit} bytes")


def error_json(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.to_response().model_dump(), status_code=err.status, headers=headers)


def error_body_bytes(err: APIError) -> bytes:
    """The error object as bytes, for plain ASGI middleware that answers without FastAPI."""
    return json.dumps(err.to_response().model_dump()).encode()


def from_exception(exc: Exception) -> APIError:
    """Map a domain exception to its API error; unknown exceptions are server errors."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SamplingParamsError | StructuredOutputsError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, TemplateError):
        return APIError(400, str(exc), param="messages")
    if isinstance(exc, EngineUnavailableError):  # dead or shutting down: another server may serve
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, EngineStepError):  # messages are written for clients; causes are logged
        return APIError(500, str(exc), code="internal_error")
    return APIError(500, "internal server error")


def validation_error(exc: RequestValidationError) -> APIError:
    errors: list[Any] = list(exc.errors())
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ())]
    if first.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first.get('msg', '')}")
    if loc == ["body"]:
        message = "request body is required" if first.get("type") == "missing" else first["msg"]
        return APIError(400, message)
    # loc is ("body", field, [index | union member, ...]); the top-level field is the param.
    fields = loc[1:] if loc and loc[0] in ("body", "query", "path") else loc
    param = fields[0] if fields else None
    where = ".".join(part for part in fields if not _is_type_tag(part))
    message = f"{where}: {first['msg']}" if where else first["msg"]
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return APIError(400, message, param=param)


def _is_type_tag(part: str) -> bool:
    """Pydantic names the union member it tried in `loc` ("list[int]", "str"): not a field."""
    return part in ("str", "int", "float", "bool") or part.startswith(
        ("list[", "dict[", "function-")
    )


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through the OpenAI error shape."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        err = from_exception(exc)
        return error_json(err, err.headers)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_json(validation_error(exc))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"route {request.method} {request.url.path} not found"
        code = "method_not_allowed" if exc.status_code == 405 else None
        headers = dict(exc.headers) if exc.headers else None
        return error_json(APIError(exc.status_code, message, code=code), headers)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = getattr(request.state, "request_id", "-")
        logger.exception("request %s failed", request_id, exc_info=exc)
        err = APIError(500, f"internal server error (request id {request_id})")
        return error_json(err, {"x-request-id": request_id})

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(SamplingParamsError, on_api_error)
    app.add_exception_handler(StructuredOutputsError, on_api_error)
    app.add_exception_handler(TemplateError, on_api_error)
    app.add_exception_handler(EngineError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
