"""One `POST /v1/files` body, parsed as it arrives: the `file` part goes straight to a temp file.

No HTTP here: the route feeds the body's chunks (`feed`, in a worker thread), then `commit`s
(fsync, rename, fsync the folder, register the row) or `discard`s. The `file` part is never held
in memory; other form fields are a few bytes each (at most MAX_FIELD_BYTES).

NOTE: python_multipart's streaming parser rather than starlette's `request.form()`, which spools
a large part to its own temp file, which we would then copy into the data folder a second time.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, BinaryIO

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from convoy.api.errors import APIError
from convoy.batch.db import BatchDB, FileRow, fsync_dir

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

# openai.types.FilePurpose: what a client may upload (batch_output files are the server's own).
PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
MAX_FIELD_BYTES = 1 << 10  # a form field other than `file` (purpose, expires_after[...])
# Form overhead allowed on top of --max-file-bytes: boundaries, part headers, small fields.
MAX_FORM_OVERHEAD = 64 << 10
USAGE = "send multipart/form-data with the fields `file` and `purpose`"
# expires_after.seconds: OpenAI's bounds (an hour to 30 days), anchored at created_at.
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 86400


def expiry_seconds(anchor: str | None, seconds: object, param: str) -> int:
    """The seconds of an `expires_after` object ({anchor: created_at, seconds}), checked."""
    if anchor != "created_at":
        raise APIError(400, f"{param}.anchor must be 'created_at'", param=f"{param}.anchor")
    try:
        value = int(str(seconds))
    except ValueError:
        value = -1
    if not MIN_EXPIRY_S <= value <= MAX_EXPIRY_S:
        message = f"{param}.seconds must be an integer from {MIN_EXPIRY_S} to {MAX_EXPIRY_S}"
        raise APIError(400, message, param=f"{param}.seconds")
    return value


def file_too_large(limit: int) -> APIError:
    message = f"the file is larger than the limit of {limit} bytes (--max-file-bytes)"
    return APIError(413, message, param="file")


def check_purpose(purpose: str) -> None:
    if purpose not in PURPOSES:
        allowed = ", ".join(PURPOSES)
        raise APIError(400, f"purpose {purpose!r} is not one of {allowed}", param="purpose")


class Upload:
    """The state of one upload: parser, temp file, form fields."""

    def __init__(self, db: BatchDB, content_type: str, max_file_bytes: int) -> None:
        kind, options = parse_options_header(content_type)
        boundary = options.get(b"boundary")
        if kind != b"multipart/form-data" or not boundary:
            raise APIError(400, f"the body is not multipart/form-data: {USAGE}")
        self.file_id = f"file-{uuid.uuid4().hex[:24]}"
        self.max_file_bytes = max_file_bytes
        self.num_file_bytes = 0
        self.filename: str | None = None  # set once the `file` part has begun
        self.fields: dict[str, str] = {}
        self._tmp = db.tmp_path(self.file_id)
        self._out: BinaryIO | None = None
        self._is_file_done = self._is_ended = False
        # NOTE: a cancelled route leaves its worker thread running; discard must wait for it.
        self._lock = threading.Lock()
        # the part being parsed
        self._header_name, self._header_value = bytearray(), bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._field: tuple[str, bytearray] | None = None  # a part that is not `file`
        try:
            self._parser = MultipartParser(boundary, self._callbacks())
        except ValueError as e:  # an over-long boundary
            raise APIError(400, f"bad multipart boundary: {e}") from None

    # -- feeding (a worker thread) ------------------------------------------------------------

    def feed(self, chunks: Iterable[bytes]) -> None:
        """Parse the next chunks of the body; `file` bytes are written as they come."""
        try:
            with self._lock:
                for chunk in chunks:
                    self._parser.write(chunk)
        except MultipartParseError as e:
            raise APIError(400, f"malformed multipart body: {e}") from None

    def commit(self, db: BatchDB) -> FileRow:
        """Check the form, make the file durable under its id and register it."""
        with self._lock:
            return self._commit(db)

    def _commit(self, db: BatchDB) -> FileRow:
        if not self._is_ended:
            raise APIError(400, f"the multipart body ended before its closing boundary: {USAGE}")
        purpose = self.fields.get("purpose")
        if purpose is None:
            raise APIError(400, "missing form field `purpose`", param="purpose")
        if self._out is None or not self._is_file_done:
            raise APIError(400, "missing form field `file` (the file to upload)", param="file")
        if self.num_file_bytes == 0:
            raise APIError(400, "the file is empty", param="file")
        created_at = int(time.time())
        expires_at = None
        if any(k.startswith("expires_after") for k in self.fields):
            anchor = self.fields.get("expires_after[anchor]")
            seconds = self.fields.get("expires_after[seconds]")
            expires_at = created_at + expiry_seconds(anchor, seconds, "expires_after")
        self._out.flush()
        os.fsync(self._out.fileno())
        self._out.close()
        final = db.file_path(self.file_id)
        os.rename(self._tmp, final)
        fsync_dir(final.parent)  # the rename survives a crash before the row is committed
        row = FileRow(
            id=self.file_id,
            bytes=self.num_file_bytes,
            created_at=created_at,
            filename=self.filename or "file",
            purpose=purpose,
            expires_at=expires_at,
        )
        try:
            with db.transaction() as conn:
                db.insert_file(conn, row)
        except BaseException:
            final.unlink(missing_ok=True)
            raise
        db.keep_reserve()  # given up when the disk filled: made again once there is room
        return row

    def discard(self) -> None:
        """Remove the temp file of an upload that did not commit (a no-op after `commit`)."""
        with self._lock:
            if self._out is not None:
                self._out.close()
            self._tmp.unlink(missing_ok=True)

    # -- parser callbacks ---------------------------------------------------------------------

    def _callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self._headers.clear,
            "on_header_field": lambda data, start, end: self._header_name.extend(data[start:end]),
            "on_header_value": lambda data, start, end: self._header_value.extend(data[start:end]),
            "on_header_end": self._on_header_end,
            "on_headers_finished": self._on_headers_finished,
            "on_part_data": self._on_part_data,
            "on_part_end": self._on_part_end,
            "on_end": self._on_end,
        }

    def _on_header_end(self) -> None:
        self._headers[bytes(self._header_name).lower()] = bytes(self._header_value)
        self._header_name.clear()
        self._header_value.clear()

    def _on_headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition"))
        name = options.get(b"name", b"").decode("utf-8", "replace")
        if name != "file":
            self._field = (name, bytearray())
            return
        if self._out is not None:
            raise APIError(400, "more than one `file` in the form", param="file")
        self._field = None
        self.filename = options.get(b"filename", b"file").decode("utf-8", "replace")
        self._out = open(self._tmp, "xb")  # noqa: SIM115 - closed by commit or discard

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._field is None:
            assert self._out is not None
            self.num_file_bytes += end - start
            if self.num_file_bytes > self.max_file_bytes:
                raise file_too_large(self.max_file_bytes)
            self._out.write(memoryview(data)[start:end])
            return
        name, value = self._field
        value.extend(data[start:end])
        if len(value) > MAX_FIELD_BYTES:
            raise APIError(400, f"form field `{name}` is over {MAX_FIELD_BYTES} bytes", param=name)

    def _on_part_end(self) -> None:
        if self._field is None:
            self._is_file_done = True
            return
        name, value = self._field
        try:
            self.fields[name] = value.decode()
        except UnicodeDecodeError:
            raise APIError(400, f"form field `{name}` is not UTF-8", param=name) from None
        if name == "purpose":  # fail early, before a large file that may follow is read
            check_purpose(self.fields[name])

    def _on_end(self) -> None:
        self._is_ended = True
