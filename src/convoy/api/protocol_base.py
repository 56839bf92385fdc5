"""The base classes of every wire model (the protocol_*.py modules, batch/)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestModel(OpenAIModel):
    """A request body (or a part of one): strict JSON types, finite numbers, extras ignored."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def is_none(value: object) -> bool:
    """`exclude_if` of optional response fields that OpenAI omits rather than sends as null."""
    return value is None
