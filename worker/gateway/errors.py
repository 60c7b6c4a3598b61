"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}` with the
HTTP status OpenAI uses, so the official SDKs raise the exception users expect
(`BadRequestError` for 400, `AuthenticationError` 401, `PermissionDeniedError` 403,
`NotFoundError` 404, `RateLimitError` 429 (retried by the SDKs, after `Retry-After`),
`InternalServerError` 5xx). `error_for_outcome` maps a job's non-success terminal
event onto the same vocabulary."""

from __future__ import annotations

from typing import Any

from schemas.wire import Finished, FinishReason

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout", 409: "conflict_error", 413: "invalid_request_error",
          429: "rate_limit_exceeded", 500: "server_error", 503: "server_error", 504: "timeout"}

# Engine reject reasons (finished(rejected).error.code) that mean "the request is too
# big for this model": OpenAI's code for that.
_CONTEXT_CODES = {"prompt_too_long", "exceeds_context", "exceeds_kv_capacity"}


class ApiError(Exception):
    """An HTTP error answered in OpenAI's format.

    Args:
        status: HTTP status.
        message: one line for the caller (never a secret or a traceback).
        param: the request field at fault (`tools`, `messages[0].role`), if any.
        code: machine-readable code (`unsupported_parameter`, `invalid_api_key`, ...).
        headers: extra response headers (`Retry-After`).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.type = type_ or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def invalid_json() -> ApiError:
    """400 for a request body that does not parse as JSON (OpenAI's message)."""
    return bad_request("We could not parse the JSON body of your request.", code="invalid_json")


def unsupported(param: str, why: str = "") -> ApiError:
    """400 for a field OpenAI defines that this server does not implement."""
    return ApiError(400, f"Unsupported parameter: '{param}' is not supported by this server{why}.", param=param,
                    code="unsupported_parameter")


def overloaded(retry_after_s: int, message: str) -> ApiError:
    """429 with `Retry-After`: the job would wait longer than the request may."""
    return ApiError(429, message, code="overloaded", headers={"Retry-After": str(retry_after_s)})


def error_for_outcome(fin: Finished, retry_after_s: int) -> ApiError:
    """The HTTP error for a job that ended without a completion (`rejected`, `expired`,
    `error`, `cancelled`)."""
    code = fin.error.code if fin.error else None
    detail = fin.error.message if fin.error else fin.finish_reason.value
    if fin.finish_reason == FinishReason.REJECTED:
        if code in _CONTEXT_CODES:
            return ApiError(400, detail, param="messages" if "messages" in detail else None,
                            code="context_length_exceeded")
        if code == "overloaded":
            return overloaded(retry_after_s, f"the server is overloaded: {detail}")
        return ApiError(400, detail, code=code or "invalid_request")
    if fin.finish_reason == FinishReason.EXPIRED:
        return overloaded(retry_after_s, "the request waited longer than its timeout for a free slot; retry later")
    if fin.finish_reason == FinishReason.CANCELLED:
        return ApiError(409, "the request was cancelled", code="cancelled")
    if code == "oom":
        return ApiError(503, f"the server ran out of memory on this request: {detail}", code="oom")
    return ApiError(500, f"the engine failed on this request: {detail}", code=code or "internal")
