"""Fault injection for tests: make the next engine step raise, or kill the engine thread.

Off unless `CONVOY_FAULT_FILE` names a file path when the engine starts; then, before running
each step, the engine reads that file (if present), deletes it and obeys the command in it:

    step   the next step fails as if the model had raised (the requests it ran get an error)
    side   the next side step fails so (EngineCore's side steps; ordinary steps leave it be)
    kill   the engine thread dies (a BaseException, as a fatal bug would)

A file and not a flag so that a test can trigger a fault in a running server process at the
moment it chooses. Write it atomically (write a temp file, then rename) so a half-written command
is never read.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "CONVOY_FAULT_FILE"


class InjectedFault(RuntimeError):
    """The failure of a step made to fail on purpose."""


class InjectedKill(BaseException):
    """Escapes every `except Exception`, as a fatal fault would, and ends the engine thread."""


class FaultInjector:
    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        """The injector when the environment asks for one; None (the normal case) otherwise."""
        path = os.environ.get(ENV_VAR)
        return cls(Path(path)) if path else None

    def check(self, side: bool = False) -> None:
        """Raise the fault the file asks for, once (the file is consumed); `side`: the check of
        a side step, the only one that obeys (and consumes) `side`."""
        try:
            command = self.path.read_text().strip()
        except FileNotFoundError:
            return
        if side != (command == "side"):
            return  # a side step obeys "side" only, and an ordinary step leaves it be
        self.path.unlink(missing_ok=True)
        if command == "kill":
            raise InjectedKill("engine thread killed by the fault hook")
        if command in ("step", "side"):
            raise InjectedFault(f"engine {command} step failed by the fault hook")
        raise ValueError(f"{self.path}: unknown fault command {command!r} (step, side, kill)")


def request_fault(path: Path, command: str) -> None:
    """Ask the engine watching `path` for a fault at its next step (tests call this)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(command)
    os.replace(tmp, path)  # atomic: the engine never reads half a command
