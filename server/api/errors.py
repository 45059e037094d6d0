"""OpenAI's error envelope, for every error the server answers, and the handlers that make it so.

Every failure, including Litestar's own (unknown route, wrong method, body too large) and
unexpected exceptions, leaves the server as::

    {"error": {"message": "...", "type": "...", "param": null | "...", "code": null | "..."}}
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

import msgspec
from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException, MethodNotAllowedException, NotFoundException
from litestar.types import ExceptionHandlersMap

from server.engine.types import EngineError
from tenancy.errors import AuthError, UnknownTenant

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
PERMISSION = "permission_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorEnvelope(msgspec.Struct):
    error: ErrorBody


class ApiError(Exception):
    """A request failure with its HTTP status and OpenAI error fields.

    Raise it anywhere under a route handler; the exception handler turns it into the envelope.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def envelope(self) -> ErrorEnvelope:
        return ErrorEnvelope(ErrorBody(self.message, self.type, self.param, self.code))

    @classmethod
    def from_engine(cls, error: EngineError) -> ApiError:
        return cls(error.status, error.message, type=error.type, param=error.param, code=error.code)


def envelope_response(error: ApiError) -> Response[bytes]:
    return Response(
        content=msgspec.json.encode(error.envelope()),
        status_code=error.status,
        media_type=MediaType.JSON,
        headers=error.headers,
    )


# Litestar statuses -> (OpenAI type, code) for errors raised by the framework itself.
_HTTP_STATUS_FIELDS: dict[int, tuple[str, str | None]] = {
    400: (INVALID_REQUEST, None),
    401: (AUTHENTICATION, "invalid_api_key"),
    403: (PERMISSION, "insufficient_permissions"),
    404: (NOT_FOUND, "not_found"),
    405: (INVALID_REQUEST, "method_not_allowed"),
    413: (INVALID_REQUEST, "request_too_large"),
    415: (INVALID_REQUEST, "unsupported_media_type"),
    422: (INVALID_REQUEST, "invalid_type"),
    429: (INVALID_REQUEST, "rate_limit_exceeded"),
}


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return f"HTTP {status}"


def _from_http_exception(request: Request[Any, Any, Any], exc: HTTPException) -> ApiError:
    status = exc.status_code
    error_type, code = _HTTP_STATUS_FIELDS.get(status, (SERVER_ERROR if status >= 500 else INVALID_REQUEST, None))
    headers = dict(exc.headers or {})
    if isinstance(exc, NotFoundException):
        message = f"no route for {request.method} {request.url.path}"
    elif isinstance(exc, MethodNotAllowedException):
        message = f"method {request.method} is not allowed on {request.url.path}"
    elif status == 413:
        limit = request.route_handler.resolve_request_max_body_size()
        message = "request body too large" + (f": the limit is {limit} bytes" if limit else "")
    elif status >= 500:
        message = _phrase(status)  # the detail may hold internals
    else:
        message = exc.detail or _phrase(status)
    return ApiError(status, message, type=error_type, code=code, headers=headers)


def _handle_api_error(request: Request[Any, Any, Any], exc: ApiError) -> Response[bytes]:
    return envelope_response(exc)


def _handle_http_exception(request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    if exc.status_code >= 500:
        log.error("%s %s failed: %s", request.method, request.url.path, exc.detail)
    return envelope_response(_from_http_exception(request, exc))


def _handle_auth_error(request: Request[Any, Any, Any], exc: AuthError) -> Response[bytes]:
    error_type = PERMISSION if exc.status_code == 403 else AUTHENTICATION
    headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
    return envelope_response(ApiError(exc.status_code, str(exc), type=error_type, code=exc.code,
                                      headers=headers))


def _handle_unknown_tenant(request: Request[Any, Any, Any], exc: UnknownTenant) -> Response[bytes]:
    return envelope_response(ApiError(404, str(exc), type=NOT_FOUND, param="tenant",
                                      code="tenant_not_found"))


def _handle_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    # A bug: log the traceback, answer 500 without leaking internals, keep serving.
    log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return envelope_response(ApiError(500, f"internal server error ({type(exc).__name__})",
                                      type=SERVER_ERROR, code="internal_error"))


def exception_handlers() -> ExceptionHandlersMap:
    """Handlers that put every error of the app into the OpenAI envelope."""
    return {
        ApiError: _handle_api_error,
        AuthError: _handle_auth_error,
        UnknownTenant: _handle_unknown_tenant,
        HTTPException: _handle_http_exception,
        Exception: _handle_unexpected,
    }
