"""Where the Batch API's files live: uploaded inputs, output and error files, and each
batch's manifest (its durable state), in one directory.

    <files_dir>/files/<file_id>.json      metadata: the OpenAI file object + its tenant
    <files_dir>/files/<file_id>.data      content
    <files_dir>/batches/<batch_id>.json   manifest (see worker.gateway.batch.state)
    <files_dir>/batches/<batch_id>.cancel cancel request (any gateway may write it)

A local directory needs nothing else; several gateways share one directory on shared
storage (NFS, EFS, a ReadWriteMany volume). Every write goes to a temporary name in the
same directory, is fsynced and renamed into place, so a reader (or a gateway that dies
mid-write) never sees a partial file. Ids are checked against a strict pattern before
they touch a path. All methods block: call them through `asyncio.to_thread` for anything
large.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Iterable
from pathlib import Path

import msgspec

FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")
BATCH_ID = re.compile(r"^batch_[0-9a-f]{32}$")
PURPOSES = ("batch", "batch_output")


class FileObject(msgspec.Struct, kw_only=True):
    """OpenAI's file object."""

    id: str
    object: str = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class StoredFile(msgspec.Struct, kw_only=True):
    file: FileObject
    tenant: str | None = None


_meta_decoder = msgspec.json.Decoder(StoredFile)


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


class FileStore:
    """The Files API's files on a local or shared directory, with their metadata and owners.

    Args: root: the directory (created if missing).

    Raises:
        OSError: the directory cannot be created.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.files = self.root / "files"
        self.batches = self.root / "batches"
        self.files.mkdir(parents=True, exist_ok=True)
        self.batches.mkdir(parents=True, exist_ok=True)

    # ---- files ---------------------------------------------------------------------------
    def create_file(self, chunks: Iterable[bytes] | bytes, *, filename: str, purpose: str, tenant: str | None,
                    file_id: str | None = None) -> FileObject:
        """Store a file (content first, then its metadata: a file is visible only once
        complete). `file_id`: a fixed id (rewriting it replaces the file), else a new one."""
        file_id = file_id or new_file_id()
        self._check(FILE_ID, file_id)
        size = _write_atomic(self.files / f"{file_id}.data", [chunks] if isinstance(chunks, bytes) else chunks)
        obj = FileObject(id=file_id, bytes=size, created_at=int(time.time()), filename=filename, purpose=purpose)
        _write_atomic(self.files / f"{file_id}.json", [msgspec.json.encode(StoredFile(file=obj, tenant=tenant))])
        return obj

    def file(self, file_id: str) -> StoredFile | None:
        """A file's metadata and tenant, or None if there is no such file."""
        if not FILE_ID.match(file_id):
            return None
        try:
            return _meta_decoder.decode((self.files / f"{file_id}.json").read_bytes())
        except FileNotFoundError:
            return None

    def content_path(self, file_id: str) -> Path:
        self._check(FILE_ID, file_id)
        return self.files / f"{file_id}.data"

    def read_content(self, file_id: str) -> bytes:
        """Raises FileNotFoundError."""
        return self.content_path(file_id).read_bytes()

    # ---- batch manifests -------------------------------------------------------------------
    def write_manifest(self, batch_id: str, data: bytes) -> None:
        self._check(BATCH_ID, batch_id)
        _write_atomic(self.batches / f"{batch_id}.json", [data])

    def read_manifest(self, batch_id: str) -> bytes | None:
        if not BATCH_ID.match(batch_id):
            return None
        try:
            return (self.batches / f"{batch_id}.json").read_bytes()
        except FileNotFoundError:
            return None

    def manifest_ids(self) -> list[str]:
        """Ids of every batch with a manifest."""
        return sorted(p.stem for p in self.batches.glob("batch_*.json") if BATCH_ID.match(p.stem))

    def request_cancel(self, batch_id: str) -> None:
        """Record that the batch should be cancelled (read by whichever gateway drives it)."""
        self._check(BATCH_ID, batch_id)
        _write_atomic(self.batches / f"{batch_id}.cancel", [str(int(time.time())).encode()])

    def cancel_requested(self, batch_id: str) -> bool:
        return (self.batches / f"{batch_id}.cancel").exists()

    @staticmethod
    def _check(pattern: re.Pattern, value: str) -> None:
        if not pattern.match(value):
            raise ValueError(f"invalid id {value!r}")


def _write_atomic(path: Path, chunks: Iterable[bytes]) -> int:
    """Write to `<path>.<random>.tmp`, fsync, rename over `path`; returns the size."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    size = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                size += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size
