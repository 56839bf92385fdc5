"""/v1/files routes: uploads streamed to disk (convoy/batch/upload.py), listed, read back and
deleted (convoy/batch/files.py); wire types in api/protocol_batch.py. Every database
call and every disk read or write runs in a worker thread: a commit fsyncs, and the database
mutex may be held by a batch committing its lines, so the event loop never waits on either.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from typing import Any, BinaryIO, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import StreamingResponse

from convoy.api.errors import APIError, disk_full
from convoy.api.protocol_batch import FILES_PATH, FileDeleted, FileList, FileObject
from convoy.api.protocol_common import ErrorResponse
from convoy.batch import files as store
from convoy.batch.db import BatchDB, FileRow, is_disk_full
from convoy.batch.upload import MAX_FORM_OVERHEAD, PURPOSES, Upload, file_too_large
from convoy.config import ServerConfig

MAX_LIST_LIMIT = 10_000
CHUNK_BYTES = 1 << 20  # upload and download granularity: one worker-thread hop per MiB
# Purposes whose files are JSONL by contract; others are sent as opaque bytes.
_JSONL_PURPOSES = frozenset({"batch", "batch_output"})


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse} for status in statuses}


_UPLOAD_DOCS: dict[str, Any] = {
    "responses": _errors(400, 413, 503, 507),
    "openapi_extra": {
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["file", "purpose"],
                        "properties": {
                            "file": {"type": "string", "format": "binary"},
                            "purpose": {"type": "string", "enum": list(PURPOSES)},
                        },
                    }
                }
            },
        }
    },
}


def add_file_routes(app: FastAPI, settings: ServerConfig) -> None:
    """The /v1/files routes over `app.state.batch_db` (None: 503)."""

    def db_of(request: Request) -> BatchDB:
        db: BatchDB | None = request.app.state.batch_db
        if db is None:
            message = (
                "files and batches are unavailable: another Convoy process holds this server's"
                " data folder (give each server its own --data-dir)"
            )
            raise APIError(503, message, code="data_dir_busy")
        return db

    @app.post(FILES_PATH, **_UPLOAD_DOCS)
    async def create_file(request: Request) -> FileObject:
        row = await _receive_upload(request, db_of(request), settings.max_file_bytes)
        return _file_object(row)

    @app.get(FILES_PATH, responses=_errors(400, 503))
    async def list_files(
        request: Request,
        purpose: str | None = None,
        limit: int = Query(MAX_LIST_LIMIT, ge=1, le=MAX_LIST_LIMIT),
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> FileList:
        db = db_of(request)
        rows = await asyncio.to_thread(
            db.read, lambda c: store.page(c, purpose, limit, order, after)
        )
        if rows is None:
            raise APIError(400, f"after: no file with id {after!r}", param="after")
        data = [_file_object(FileRow(*row)) for row in rows[:limit]]
        first_id, last_id = (data[0].id, data[-1].id) if data else (None, None)
        return FileList(data=data, first_id=first_id, last_id=last_id, has_more=len(rows) > limit)

    @app.get(FILES_PATH + "/{file_id}", responses=_errors(404, 503))
    async def retrieve_file(request: Request, file_id: str) -> FileObject:
        return _file_object(await _get(db_of(request), file_id))

    @app.get(
        FILES_PATH + "/{file_id}/content",
        response_class=StreamingResponse,
        responses={200: {"content": {"application/octet-stream": {}}}, **_errors(404, 503)},
    )
    async def file_content(request: Request, file_id: str) -> StreamingResponse:
        db = db_of(request)
        row = await _get(db, file_id)
        try:
            # NOTE: opened before answering, so a DELETE from now on cannot cut the stream short.
            f = await asyncio.to_thread(open, db.file_path(file_id), "rb")
        except FileNotFoundError:  # deleted since the lookup
            raise _not_found(file_id) from None
        media = (
            "application/jsonl" if row.purpose in _JSONL_PURPOSES else "application/octet-stream"
        )
        headers = {"content-length": str(row.bytes)}
        return StreamingResponse(_read_chunks(f), media_type=media, headers=headers)

    @app.delete(FILES_PATH + "/{file_id}", responses=_errors(404, 409, 503))
    async def delete_file(request: Request, file_id: str) -> FileDeleted:
        db = db_of(request)
        await _get(db, file_id)
        deleted = await asyncio.to_thread(store.delete, db, file_id)
        if deleted is None:
            message = f"file {file_id} is the input of a batch in progress; cancel the batch first"
            raise APIError(409, message, param="id", code="file_in_use")
        if not deleted:
            raise _not_found(file_id)  # a concurrent DELETE won
        return FileDeleted(id=file_id, deleted=True)


async def _receive_upload(request: Request, db: BatchDB, max_file_bytes: int) -> FileRow:
    """Stream the body into an Upload a MiB at a time (parsed and written in a worker thread).

    The limit is checked on Content-Length first, then on the bytes as they come (a chunked
    body, or one that lies); the file part itself is held to `max_file_bytes` exactly.
    """
    max_body = max_file_bytes + MAX_FORM_OVERHEAD
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body:
        raise file_too_large(max_file_bytes)
    upload = Upload(db, request.headers.get("content-type", ""), max_file_bytes)
    try:
        pending: list[bytes] = []
        num_pending = num_body = 0
        async for chunk in request.stream():
            num_body += len(chunk)
            if num_body > max_body:
                raise file_too_large(max_file_bytes)
            pending.append(chunk)
            num_pending += len(chunk)
            if num_pending >= CHUNK_BYTES:
                await asyncio.to_thread(upload.feed, pending)
                pending, num_pending = [], 0
        await asyncio.to_thread(upload.feed, pending)
        return await asyncio.to_thread(upload.commit, db)
    except (OSError, sqlite3.OperationalError) as e:  # written, or its row committed
        if not is_disk_full(e):
            raise
        raise disk_full("the file was not stored", e, "file") from None
    finally:
        await asyncio.to_thread(upload.discard)  # nothing half-written stays


def _file_object(row: FileRow) -> FileObject:
    return FileObject(
        id=row.id, bytes=row.bytes, created_at=row.created_at, filename=row.filename,
        purpose=row.purpose, expires_at=row.expires_at,
    )  # fmt: skip


def _not_found(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param="id")


async def _get(db: BatchDB, file_id: str) -> FileRow:
    row = await asyncio.to_thread(db.get_file, file_id)
    if row is None:
        raise _not_found(file_id)
    return row


async def _read_chunks(f: BinaryIO) -> AsyncIterator[bytes]:
    try:
        while chunk := await asyncio.to_thread(f.read, CHUNK_BYTES):
            yield chunk
    finally:
        f.close()
