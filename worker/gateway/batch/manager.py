"""The batches of one gateway process: creates them, answers reads and cancels, and runs
a `BatchDriver` for every batch it holds the lease of. Every
`gateway.batch_scan_interval_s` it rebuilds Redis from the manifests if Redis lost its
data, then adopts each active batch nobody drives (its driver's gateway died, or was
stopped): that is how a batch outlives the gateway that created it.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import structlog

from worker.gateway.auth import Grant
from worker.gateway.batch.driver import BatchDriver
from worker.gateway.batch.state import BatchObject, BatchStore, Manifest
from worker.gateway.config import parse_window
from worker.gateway.context import GatewayContext
from worker.gateway.errors import ApiError, bad_request
from worker.gateway.files import FileStore
from worker.gateway.protocol import ENDPOINT_KINDS
from worker.obs.stopping import honour_cancellation, stop_within

log = structlog.get_logger(__name__)

MAX_METADATA = 16
DRIVER_STOP_S = 30.0  # BatchManager.stop: every driver's clean-up (results consumer, lease), seconds


class BatchManager:
    """The batches of one gateway process: creates them, answers reads and cancels, drives those it leases.

    Args:
        ctx: the gateway context.
        store: batch state (Redis + manifests).
        files: the file store.
    """

    def __init__(self, ctx: GatewayContext, store: BatchStore, files: FileStore) -> None:
        self.ctx = ctx
        self.store = store
        self.files = files
        self._drivers: dict[str, asyncio.Task] = {}

    @property
    def driving(self) -> set[str]:
        """Ids of the batches this process drives now."""
        return set(self._drivers)

    async def create(self, grant: Grant, body: Any) -> BatchObject:
        """`POST /v1/batches`.

        Raises:
            ApiError: 400 (bad field), 404 (no such input file for this key).
        """
        if not isinstance(body, dict):
            raise bad_request("The request body must be a JSON object.", code="invalid_json")
        for name in body:
            if name not in ("input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"):
                raise bad_request(f"Unrecognized request argument supplied: {name}", param=name,
                                  code="unknown_parameter")
        if body.get("output_expires_after") is not None:
            raise ApiError(400, "Unsupported parameter: 'output_expires_after' is not supported by this server "
                           "(files do not expire).", param="output_expires_after", code="unsupported_parameter")
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINT_KINDS:
            raise bad_request(f"endpoint must be one of {sorted(ENDPOINT_KINDS)}, got {endpoint!r}", param="endpoint",
                              code="unsupported_endpoint")
        window = body.get("completion_window")
        seconds = parse_window(window) if isinstance(window, str) else None
        if seconds is None:
            raise bad_request(f"completion_window must be a duration such as '24h' (also 'Nm', 'Ns'), got {window!r}",
                              param="completion_window")
        metadata = body.get("metadata")
        if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items())):
            raise bad_request("metadata must map at most 16 keys (<= 64 characters) to strings (<= 512)",
                              param="metadata")
        file_id = body.get("input_file_id")
        stored = await asyncio.to_thread(self.files.file, file_id) if isinstance(file_id, str) else None
        if stored is None or stored.tenant != grant.tenant:
            raise ApiError(404, f"No such File object: {file_id}", param="input_file_id", code="file_not_found")
        if stored.file.purpose != "batch":
            raise bad_request(f"file {file_id} has purpose {stored.file.purpose!r}, not 'batch'",
                              param="input_file_id")
        now = int(time.time())
        batch = BatchObject(id="batch_" + secrets.token_hex(16), endpoint=endpoint, input_file_id=file_id,
                            completion_window=window, status="validating", created_at=now,
                            expires_at=now + int(seconds), metadata=metadata, model=self.ctx.cfg.model_name)
        m = Manifest(batch=batch, tenant=grant.tenant, priority=self.ctx.cfg.batch_priority,
                     topic_prefix=self.store.topic_prefix)
        await self.store.save(m)
        token = await self.store.take_lease(batch.id)
        if token is not None:
            self._drive(m, token)  # else the next scan (here or on another gateway) adopts it
        log.info("batch created", batch_id=batch.id, tenant=grant.tenant, endpoint=endpoint, input_file_id=file_id)
        return batch

    async def get(self, grant: Grant, batch_id: str) -> BatchObject:
        """Raises ApiError 404."""
        obj = await self.store.get(batch_id, grant.tenant)
        if obj is None:
            raise ApiError(404, f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")
        return obj

    async def list(self, grant: Grant, after: str | None, limit: int) -> dict[str, Any]:
        page, has_more = await self.store.list(grant.tenant, after, limit)
        return {"object": "list", "data": page, "first_id": page[0].id if page else None,
                "last_id": page[-1].id if page else None, "has_more": has_more}

    async def cancel(self, grant: Grant, batch_id: str) -> BatchObject:
        """`POST /v1/batches/{id}/cancel`: the driver sends the cancels of its unfinished
        lines at its next round (any gateway may take the request).

        Raises:
            ApiError: 404; 409 when the batch already ended.
        """
        obj = await self.get(grant, batch_id)
        if obj.is_terminal:
            raise ApiError(409, f"Cannot cancel a batch with status '{obj.status}'.", code="batch_not_cancellable")
        await asyncio.to_thread(self.files.request_cancel, batch_id)
        if obj.status in ("validating", "in_progress"):
            obj.status, obj.cancelling_at = "cancelling", int(time.time())
        return obj

    # ---- drivers -----------------------------------------------------------------------------
    def _drive(self, m: Manifest, token: str) -> None:
        driver = BatchDriver(self.ctx, self.store, self.files, m, token)
        task = asyncio.create_task(self._run_driver(driver), name=f"batch-{m.batch.id}")
        self._drivers[m.batch.id] = task
        self.ctx.metrics.batches_active.set(len(self._drivers))

    async def _run_driver(self, driver: BatchDriver) -> None:
        try:
            await driver.run()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the lease lapses and a scan (here or elsewhere) resumes it
            log.exception("batch driver failed; it will be resumed", batch_id=driver.batch_id, error=repr(e)[:300])
        finally:
            self._drivers.pop(driver.batch_id, None)
            self.ctx.metrics.batches_active.set(len(self._drivers))

    async def scan(self) -> None:
        """Rebuild Redis if it lost its data; adopt every active batch without a driver."""
        try:
            await self.store.reindex()
        except Exception as e:  # Redis down: try again next time
            log.warning("batch scan: Redis unreachable", error=repr(e)[:200])
            return
        for batch_id in sorted(await self.store.active_ids() - set(self._drivers)):
            token = await self.store.take_lease(batch_id)
            if token is None:
                continue
            m = await self.store.load(batch_id)
            if m is None or m.batch.is_terminal:
                if m is not None:
                    await self.store.publish(m)  # drops it from the active set
                await self.store.release_lease(batch_id, token)
                continue
            log.info("adopting batch", batch_id=batch_id, status=m.batch.status, dispatched=m.dispatched)
            self._drive(m, token)

    async def run(self) -> None:
        """Scan every `gateway.batch_scan_interval_s` until cancelled."""
        while True:
            honour_cancellation()  # a scan whose client swallowed the stop's cancel ends here
            await self.scan()
            await asyncio.sleep(self.ctx.cfg.batch_scan_interval_s)

    async def stop(self) -> None:
        """Stop every driver (their leases are released; another gateway resumes them),
        within `DRIVER_STOP_S` seconds in all (a driver's own clean-up is bounded tighter)."""
        tasks = list(self._drivers.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await stop_within(f"gateway: {len(tasks)} batch driver(s)", asyncio.gather(*tasks, return_exceptions=True),
                              DRIVER_STOP_S)
