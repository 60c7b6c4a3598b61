"""Batch input lines → jobs, and outcomes → output / error lines (OpenAI's batch file
formats).

Input, one JSON object a line: `{"custom_id": "...", "method": "POST", "url":
"/v1/chat/completions", "body": {...}}`; the body is validated exactly as the same
request sent directly (same rules, same 400 messages), plus what a batch cannot do
(`stream`, `logprobs`: outcomes come from the durable results record, which holds the
text and usage; `priority`: lines run at the batch's). A line's job id is derived from
the batch id and its `custom_id` (`<batch_id>-<sha256(custom_id)[:32]>`), so a line
dispatched twice (a gateway died between producing it and recording that) is the same
job, which a worker never runs twice. A line without a `seed` gets one derived from its
job id, so a re-run reproduces its text.

Output: `{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"},
"error": null}`; a failed request goes to the error file with its error body and
status, a line that never ran (invalid, cancelled, expired) with `response: null` and
`error: {"code", "message"}`.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, NamedTuple

import msgspec

from schemas.wire import Finished, Job
from worker.gateway.agents import OutputFormats, auto_tool_calls, output_parser
from worker.gateway.edge import check_context
from worker.gateway.errors import ApiError, error_for_outcome
from worker.gateway.protocol import GenRequest, Kind, parse_body
from worker.gateway.render import Renderer, TokenText

MAX_CUSTOM_ID = 512


class BatchLine(NamedTuple):
    """A valid input line: 1-based line number, custom_id, derived job id, request."""

    line: int
    custom_id: str
    job_id: str
    req: GenRequest


class LineError(msgspec.Struct, kw_only=True):
    """An invalid input line (OpenAI's batch error: code, message, param, line)."""

    line: int
    custom_id: str | None = None
    code: str
    message: str
    param: str | None = None


def line_job_id(batch_id: str, custom_id: str) -> str:
    return f"{batch_id}-{hashlib.sha256(custom_id.encode()).hexdigest()[:32]}"


def parse_input(data: bytes, *, batch_id: str, endpoint: str, kind: Kind, model_name: str, tokenizer: Any = None,
                max_model_len: int | None = None,
                formats: OutputFormats | None = None) -> tuple[list[BatchLine], list[LineError]]:
    """Split an input file into valid lines and errors (blank lines are skipped). With
    `tokenizer` and `max_model_len`, a line whose prompt cannot fit the context is an error
    (`context_length_exceeded`, `worker.gateway.edge`), as the same request sent directly;
    "auto" tool calls get the grammar of `formats` as they would directly."""
    lines: list[BatchLine] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    for i, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        custom_id = None
        try:
            obj = msgspec.json.decode(raw)
            if not isinstance(obj, dict):
                raise _invalid("invalid_json", "a line must be a JSON object")
            custom_id = obj.get("custom_id")
            if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
                custom_id = None
                raise _invalid("invalid_custom_id", f"custom_id must be a string of 1-{MAX_CUSTOM_ID} characters",
                               "custom_id")
            if custom_id in seen:
                raise _invalid("duplicate_custom_id", f"custom_id {custom_id!r} appears on an earlier line",
                               "custom_id")
            seen.add(custom_id)
            if obj.get("method", "POST") != "POST":
                raise _invalid("invalid_method", "method must be POST", "method")
            if obj.get("url") != endpoint:
                raise _invalid("mismatched_url", f"url must be the batch's endpoint {endpoint}", "url")
            req = parse_body(kind, obj.get("body"))
            auto_tool_calls(req, formats or OutputFormats())
            for name, given in (("stream", req.stream), ("logprobs", req.logprobs is not None),
                                ("priority", req.priority is not None), ("n", req.n != 1)):
                if given:
                    raise _invalid("unsupported_parameter", f"'{name}' is not supported in batch lines", f"body.{name}")
            if req.model != model_name:
                raise _invalid("model_not_found", f"the model `{req.model}` does not exist", "body.model")
            check_context(req, tokenizer, max_model_len)
        except msgspec.DecodeError:
            errors.append(LineError(line=i, code="invalid_json", message="the line is not valid JSON"))
            continue
        except ApiError as e:
            param = e.param if e.param is None or e.param.startswith(("custom_id", "method", "url", "body.")) \
                else f"body.{e.param}"
            errors.append(LineError(line=i, custom_id=custom_id, code=e.code or "invalid_request",
                                    message=e.message, param=param))
            continue
        lines.append(BatchLine(i, custom_id, line_job_id(batch_id, custom_id), req))
    return lines, errors


def _invalid(code: str, message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def line_job(line: BatchLine, tenant: str | None, deadline: float, batch_id: str) -> Job:
    """The job of a valid line (seeded from its job id when the line has no seed)."""
    params = line.req.params
    if params.seed is None:
        seed = int.from_bytes(hashlib.sha256(line.job_id.encode()).digest()[:4], "big") & 0x7FFFFFFF
        params = msgspec.structs.replace(params, seed=seed)
    return Job(job_id=line.job_id, prompt=line.req.prompt, messages=line.req.messages,
               prompt_token_ids=line.req.prompt_token_ids, params=params, tools=line.req.tools, tenant=tenant,
               deadline=deadline, chat_template_kwargs=line.req.chat_template_kwargs,
               created_at=time.time(), metadata={"batch_id": batch_id, "custom_id": line.custom_id})


def _line_id(job_id: str) -> str:
    return "batch_req_" + hashlib.sha256(job_id.encode()).hexdigest()[:32]


def output_line(line: BatchLine, fin: Finished, model: str, created: int,
                formats: OutputFormats | None = None) -> dict[str, Any]:
    """The output-file line of a successful request (reasoning and "auto" tool calls read
    with `formats`, as for the same request sent directly)."""
    prefix = "chatcmpl-" if line.req.kind == Kind.CHAT else "cmpl-"
    body = Renderer(line.req.kind, prefix + line.job_id, model, created, _NO_TOKENS, tool_mode=line.req.tool_mode,
                    parser=output_parser(line.req, formats or OutputFormats())).completion(fin, None)
    return {"id": _line_id(line.job_id), "custom_id": line.custom_id,
            "response": {"status_code": 200, "request_id": line.job_id, "body": body}, "error": None}


def failed_line(line: BatchLine, fin: Finished) -> dict[str, Any]:
    """The error-file line of a request whose job ended without a completion."""
    err = error_for_outcome(fin, 1)
    return {"id": _line_id(line.job_id), "custom_id": line.custom_id,
            "response": {"status_code": err.status, "request_id": line.job_id, "body": err.body()}, "error": None}


def unanswered_line(line: BatchLine, code: str, message: str) -> dict[str, Any]:
    """The error-file line of a request that never ran (batch cancelled or expired)."""
    return {"id": _line_id(line.job_id), "custom_id": line.custom_id, "response": None,
            "error": {"code": code, "message": message}}


def invalid_line(err: LineError) -> dict[str, Any]:
    """The error-file line of an invalid input line."""
    return {"id": f"batch_req_line_{err.line}", "custom_id": err.custom_id, "response": None,
            "error": {"code": err.code, "message": f"line {err.line}: {err.message}", "param": err.param,
                      "line": err.line}}


_NO_TOKENS = TokenText(None)
