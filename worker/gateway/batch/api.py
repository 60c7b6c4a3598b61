"""The Batch API's HTTP side: `POST /v1/files` (purpose `batch`, JSONL), `GET
/v1/files/{file_id}`, `GET /v1/files/{file_id}/content`, `POST /v1/batches`, `GET
/v1/batches/{batch_id}`, `GET /v1/batches`, `POST /v1/batches/{batch_id}/cancel`. Every
file and batch belongs to the tenant of the key that created it; other keys get 404."""

from __future__ import annotations

import asyncio
import os
import tempfile

import msgspec
from aiohttp import BodyPartReader, web

from worker.gateway.batch.manager import BatchManager
from worker.gateway.context import GatewayContext, json_ok
from worker.gateway.errors import ApiError, bad_request, invalid_json
from worker.gateway.files import FileStore

UPLOAD_CHUNK = 1 << 20


class BatchHandlers:
    """The HTTP handlers of the Files and Batch endpoints.

    Args: ctx: the gateway context; files: the file store; batches: the manager."""

    def __init__(self, ctx: GatewayContext, files: FileStore, batches: BatchManager) -> None:
        self.ctx = ctx
        self.files = files
        self.batches = batches

    # ---- files -----------------------------------------------------------------------------
    async def upload(self, request: web.Request) -> web.Response:
        """Multipart form: `purpose` (`batch`) and `file` (JSONL)."""
        grant = self.ctx.grant(request)
        if not request.content_type.startswith("multipart/"):
            raise bad_request("upload the file as multipart/form-data with fields 'file' and 'purpose'",
                              param="file")
        reader = await request.multipart()
        purpose, filename, spooled = None, None, None
        try:
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    continue
                if part.name == "purpose":
                    purpose = (await part.text()).strip()
                elif part.name == "file":
                    filename = part.filename or "upload.jsonl"
                    spooled = await self._spool(part)
            if purpose != "batch":
                raise bad_request(f"purpose must be 'batch' (the only purpose this server stores), got {purpose!r}",
                                  param="purpose")
            if spooled is None:
                raise bad_request("the form has no 'file' field", param="file")
            obj = await asyncio.to_thread(self._store, spooled, filename, grant.tenant)
        finally:
            if spooled is not None:
                spooled.close()
        return json_ok(obj)

    async def _spool(self, part: BodyPartReader):
        """The part's bytes in a temporary file (bounded by `gateway.max_file_bytes`)."""
        limit = self.ctx.cfg.max_file_bytes
        f = tempfile.TemporaryFile()  # noqa: SIM115 (returned: the caller closes it)
        size = 0
        while chunk := await part.read_chunk(UPLOAD_CHUNK):
            size += len(chunk)
            if size > limit:
                f.close()
                raise ApiError(413, f"file over {limit} bytes (gateway.max_file_bytes)", param="file",
                               code="file_too_large")
            f.write(chunk)
        f.seek(0)
        return f

    def _store(self, f, filename: str, tenant: str | None):
        return self.files.create_file(iter(lambda: f.read(UPLOAD_CHUNK), b""), filename=os.path.basename(filename),
                                      purpose="batch", tenant=tenant)

    async def _own_file(self, request: web.Request):
        grant = self.ctx.grant(request)
        file_id = request.match_info["file_id"]
        stored = await asyncio.to_thread(self.files.file, file_id)
        if stored is None or stored.tenant != grant.tenant:
            raise ApiError(404, f"No such File object: {file_id}", param="file_id", code="file_not_found")
        return stored

    async def file(self, request: web.Request) -> web.Response:
        return json_ok((await self._own_file(request)).file)

    async def content(self, request: web.Request) -> web.StreamResponse:
        stored = await self._own_file(request)
        return web.FileResponse(self.files.content_path(stored.file.id),
                                headers={"Content-Type": "application/jsonl"})

    # ---- batches ---------------------------------------------------------------------------
    async def create(self, request: web.Request) -> web.Response:
        grant = self.ctx.grant(request)
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError:
            raise invalid_json() from None
        return json_ok(await self.batches.create(grant, body))

    async def get(self, request: web.Request) -> web.Response:
        return json_ok(await self.batches.get(self.ctx.grant(request), request.match_info["batch_id"]))

    async def list(self, request: web.Request) -> web.Response:
        grant = self.ctx.grant(request)
        try:
            limit = int(request.query.get("limit", "20"))
        except ValueError:
            raise bad_request("limit must be an integer", param="limit") from None
        if not 1 <= limit <= 100:
            raise bad_request("limit must be in [1, 100]", param="limit")
        return json_ok(await self.batches.list(grant, request.query.get("after"), limit))

    async def cancel(self, request: web.Request) -> web.Response:
        return json_ok(await self.batches.cancel(self.ctx.grant(request), request.match_info["batch_id"]))
