"""Why the engine could not finish a request. No HTTP here: api/errors.py maps each to a status.

EngineStepError      a step (or queueing the request) failed; the engine goes on  -> 500
EngineDeadError      the engine thread died; nothing will be served again          -> 503
EngineShutdownError  the engine is stopping; requests in flight and new ones end   -> 503
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of the engine's failures as a caller of `AsyncEngine.generate` sees them."""


class EngineStepError(EngineError):
    """An engine step failed: the requests it ran are ended, their KV blocks freed.

    `request_ids` are the prompts (EngineRequest ids) that had a sequence in the failed step;
    `errors`, what to tell some of them instead (a constraint that failed: a client error).
    """

    def __init__(
        self,
        message: str,
        request_ids: frozenset[str] = frozenset(),
        errors: dict[str, Exception] | None = None,
    ) -> None:
        super().__init__(message)
        self.request_ids = request_ids
        self.errors = errors or {}


class EngineUnavailableError(EngineError):
    """The engine takes no more work: requests waiting on it end, new ones are refused."""


class EngineDeadError(EngineUnavailableError):
    """The engine thread died."""


class EngineShutdownError(EngineUnavailableError):
    """The engine is shutting down."""
