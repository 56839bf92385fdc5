"""Wire types of /v1/batches, as the official `openai` client's `Batch` defines them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from convoy.api.protocol_base import OpenAIModel, RequestModel

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses")
COMPLETION_WINDOWS = ("24h",)
BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
    "cancelled",
]  # fmt: skip
TERMINAL_STATUSES = ("failed", "completed", "expired", "cancelled")
MAX_METADATA_KEYS = 16  # OpenAI's metadata limits
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class ExpiresAfter(RequestModel):
    """When files made from a request expire: `seconds` after their creation."""

    anchor: str
    seconds: int


class BatchCreateRequest(RequestModel):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None

    @field_validator("metadata")
    @classmethod
    def _bounded(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} metadata keys")
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(item) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(
                    f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters and values"
                    f" at most {MAX_METADATA_VALUE_CHARS}"
                )
        return value


class BatchError(OpenAIModel):
    code: str | None = None
    line: int | None = None  # 1-based line of the input file
    message: str | None = None
    param: str | None = None


class BatchErrors(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[BatchError] = Field(default_factory=list)


class BatchRequestCounts(OpenAIModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class InputTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0


class BatchUsage(OpenAIModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class Batch(OpenAIModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = Field(default_factory=BatchRequestCounts)
    usage: BatchUsage = Field(default_factory=BatchUsage)
    model: str | None = None
    metadata: dict[str, str] | None = None


class BatchList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


# /v1/files: shapes as the official `openai` client's FileObject, FileDeleted and cursor page.
FILES_PATH = "/v1/files"
# Routes that hold their bodies to their own limit as they stream (--max-file-bytes).
UPLOAD_ROUTES = frozenset({("POST", FILES_PATH)})


class FileObject(OpenAIModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(OpenAIModel):
    """A cursor page: the client asks for the next one with `after=last_id` while `has_more`."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(OpenAIModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool
