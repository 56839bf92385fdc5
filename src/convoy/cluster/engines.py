"""What a cluster actor runs a shard on: the real engine, or a fake one for tests and benches.

    ShardEngine.run_shard(lines) -> LineResults   (several shards at once on one engine)

`ServingShardEngine` is `convoy batch`'s in-process serving (batch/inprocess.py): the
shard's lines are prepared as `convoy batch` prepares them and run through one BatchExecutor
shared by every shard in flight on the actor, so its continuous batch stays full.

`FakeShardEngine` (`--fake-engine STEP_MS:CAP`, test and bench only) keeps the line rules but
answers each good line with a line that is a function of its custom_id alone: every STEP_MS it
answers up to CAP waiting lines of all the actor's shards, as a continuous batch would. Its
throughput is CAP / STEP_MS per actor whatever the host's cores, so scaling over actors and
outputs across actor counts can be compared on a 2-core machine.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
from collections.abc import Callable
from typing import Protocol

from convoy.batch.executor import LineResult
from convoy.batch.inprocess import InProcessServing, run_endpoints
from convoy.batch.lines import InputLine
from convoy.batch.offline_lines import ScannedLine, prepare
from convoy.batch.offline_state import JobError

OnResult = Callable[[LineResult], None]


class ShardEngine(Protocol):
    """Built once per actor with an `on_result` callback (called as each line finishes)."""

    async def run_shard(self, items: list[ScannedLine]) -> list[LineResult]:
        """Every line's result (a bad line's is an error line). Raises EngineStopped when the
        engine is gone: the actor must then die, so that Ray retries its shards."""
        ...


class ServingShardEngine:
    def __init__(self, serving: InProcessServing, on_result: OnResult) -> None:
        self.serving = serving
        self.executor = serving.executor(on_result)  # one window over all shards in flight

    async def run_shard(self, items: list[ScannedLine]) -> list[LineResult]:
        results: list[LineResult] = []

        def lines_of(endpoint: str) -> list[InputLine | LineResult]:
            return [prepare(i, self.serving.model) for i in items if i.endpoint == endpoint]

        async def ledger(group: list[LineResult]) -> None:  # the driver makes them durable
            results.extend(group)

        await run_endpoints(self.executor, lines_of, ledger)
        return results


def parse_fake_engine(spec: str) -> tuple[float, int]:
    """`STEP_MS:CAP` -> (step seconds, lines a step); JobError (exit 2) when malformed."""
    try:
        step_ms, cap = spec.split(":")
        step_s, num = float(step_ms) / 1000, int(cap)
    except ValueError:
        raise JobError(f"--fake-engine takes STEP_MS:CAP, got {spec!r}", 2) from None
    if step_s < 0 or num <= 0:
        raise JobError(f"--fake-engine takes STEP_MS >= 0 and CAP > 0, got {spec!r}", 2)
    return step_s, num


def fake_line(custom_id: str) -> str:
    """The fake engine's answer: an output line that depends on the custom_id alone."""
    digest = hashlib.sha256(custom_id.encode()).hexdigest()
    body = {"object": "fake.completion", "text": digest[:16]}
    line = {
        "id": f"batch_req_{digest[:32]}", "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": f"req_{digest[32:]}", "body": body},
        "error": None,
    }  # fmt: skip
    return json.dumps(line) + "\n"


class FakeShardEngine:
    def __init__(self, spec: str, model: str, on_result: OnResult) -> None:
        self.step_s, self.cap = parse_fake_engine(spec)
        self.model, self.on_result = model, on_result
        self._waiting: collections.deque[tuple[InputLine, asyncio.Future[LineResult]]] = (
            collections.deque()
        )
        self._stepper: asyncio.Task[None] | None = None  # runs while lines wait

    async def run_shard(self, items: list[ScannedLine]) -> list[LineResult]:
        loop = asyncio.get_running_loop()
        pending = []
        for item in items:
            line = prepare(item, self.model)
            future: asyncio.Future[LineResult] = loop.create_future()
            if isinstance(line, LineResult):
                future.set_result(line)
            else:
                self._waiting.append((line, future))
            pending.append(future)
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.create_task(self._step_loop())
        results = []
        for finished in asyncio.as_completed(pending):
            result = await finished
            self.on_result(result)
            results.append(result)
        return results

    async def _step_loop(self) -> None:
        """Each step: take up to `cap` waiting lines, wait `step_s`, answer them; end when no
        line waits (the next shard starts it again)."""
        while self._waiting:
            batch = [self._waiting.popleft() for _ in range(min(self.cap, len(self._waiting)))]
            await asyncio.sleep(self.step_s)
            for line, future in batch:
                text = fake_line(line.custom_id)
                future.set_result(LineResult(line.index, line.custom_id, True, text, 0, 1))
