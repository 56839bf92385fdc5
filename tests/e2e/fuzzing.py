"""Schemathesis fuzzing of a running server, shared by tests/e2e/test_fuzz.py and bench/fuzz.py.

Cases are generated from the server's own `/openapi.json` for the generation and tokenizer routes,
half valid bodies (POSITIVE: inside every type, range and bound the schema states) and half
invalid ones (NEGATIVE: wrong types, values out of range, missing fields), and sent over HTTP one
at a time. A case fails when the server answers 5xx, sends a `server_error` frame in a stream,
answers an error that is not an OpenAI error object, or does not answer within CASE_TIMEOUT_S.
"""

from __future__ import annotations

import heapq
import json
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.e2e.helpers import MODEL

FUZZ_ROUTES = (
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/tokenize",
    "/detokenize",
)  # fmt: skip
# `convoy serve` flags that keep every valid case cheap: a short context bounds the tokens any
# request can generate (max_tokens must fit it), and each request starts at most 4 sequences.
SERVE_ARGS = [
    MODEL, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "64MiB",
    "--max-model-len", "48", "--max-prompts-per-request", "2",
    "--max-seqs-per-request", "4", "--max-queue-seqs", "4",
]  # fmt: skip
# OMP_NUM_THREADS for the fuzzed server: one thread slows gracefully when a neighbour is busy
# (two spinning threads on a shared 2-core machine can be 10x slower per step).
FUZZ_THREADS = 1
CASE_TIMEOUT_S = 30  # no byte for this long: a hang
_ERROR_KEYS = ["message", "type", "param", "code"]


@dataclass
class FuzzReport:
    statuses: Counter[str] = field(default_factory=Counter)  # "POST /tokenize 400" -> count
    failures: list[str] = field(default_factory=list)
    slowest: list[tuple[float, str]] = field(default_factory=list)  # (seconds, case), a heap
    seconds: float = 0.0

    @property
    def num_cases(self) -> int:
        return sum(self.statuses.values())

    def record(self, label: str, status: int | str, problem: str | None, sent: bytes) -> None:
        self.statuses[f"{label} {status}"] += 1
        if problem is not None:
            self.failures.append(f"{label}: {problem}; sent {sent[:300]!r}")

    def timed(self, seconds: float, label: str, sent: bytes) -> None:
        self.seconds += seconds
        heapq.heappush(self.slowest, (seconds, f"{label} {sent[:160]!r}"))
        if len(self.slowest) > 5:
            heapq.heappop(self.slowest)

    def table(self) -> str:
        rows = [f"{count:7d}  {key}" for key, count in sorted(self.statuses.items())]
        rows.append(f"{self.num_cases:7d}  cases, {len(self.failures)} failures")
        rows.append(f"{self.seconds:7.1f}s in requests; slowest:")
        rows += [f"{secs:7.2f}s  {case}" for secs, case in sorted(self.slowest, reverse=True)]
        return "\n".join(rows)


def _problem(response: httpx.Response) -> str | None:
    """Why an answer breaks the contract, or None."""
    if response.status_code >= 500:
        return f"status {response.status_code}"
    if response.status_code >= 400:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"status {response.status_code} without an OpenAI error object"
        if list(error) != _ERROR_KEYS:
            return f"error object keys {list(error)}"
        return None
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        if b'"server_error"' in response.content:
            return "a server_error frame in the stream"
        if response.request.url.path == "/v1/responses":  # typed events, no [DONE] (OpenAI's)
            last = response.content.rstrip().rsplit(b"\n\n", 1)[-1]
            if not last.startswith(_RESPONSE_ENDS):
                return "a Responses stream that does not end with response.completed/incomplete"
        elif not response.content.rstrip().endswith(b"data: [DONE]"):
            return "a stream that does not end with [DONE]"
    return None


_RESPONSE_ENDS = (b"event: response.completed\n", b"event: response.incomplete\n")


def _request(http: httpx.Client, case: schemathesis.Case) -> httpx.Request:
    kwargs = case.as_transport_kwargs(base_url=str(http.base_url), headers=dict(http.headers))
    content = kwargs.get("data")
    if "json" in kwargs:  # serialized here so the generated body is sent exactly as generated
        content = json.dumps(kwargs["json"]).encode()
    return http.build_request(
        kwargs["method"],
        kwargs["url"],
        headers=kwargs["headers"],
        params=kwargs.get("params"),
        content=content,
    )


def fuzz(base_url: str, headers: dict[str, str], num_cases: int, seed: int = 0) -> FuzzReport:
    """Send about `num_cases` generated cases, split evenly over FUZZ_ROUTES; never raises on a
    bad answer (the report lists them) so one run shows every failure."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", headers=headers, timeout=30)
    report = FuzzReport()
    per_route = math.ceil(num_cases / len(FUZZ_ROUTES))
    with httpx.Client(base_url=base_url, headers=headers, timeout=CASE_TIMEOUT_S) as http:
        for route in FUZZ_ROUTES:
            _fuzz_route(http, schema[route]["POST"], per_route, seed, report)
    return report


def _fuzz_route(
    http: httpx.Client, operation: Any, num_cases: int, seed: int, report: FuzzReport
) -> None:
    cases = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
    )
    label = f"{operation.method.upper()} {operation.path}"

    @hypothesis_seed(seed)
    @settings(
        max_examples=num_cases,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def one(case: schemathesis.Case) -> None:
        request = _request(http, case)
        sent = request.read()
        start = time.monotonic()
        try:
            response = http.send(request)
        except httpx.TimeoutException:
            report.record(label, "timeout", f"no answer in {CASE_TIMEOUT_S}s", sent)
            return
        except httpx.TransportError as e:
            report.record(label, "broken", f"transport error {e!r}", sent)
            return
        finally:
            report.timed(time.monotonic() - start, label, sent)
        report.record(label, response.status_code, _problem(response), sent)

    one()


def check_after_fuzzing(base_url: str, headers: dict[str, str]) -> None:
    """The server still answers a normal request (raises otherwise)."""
    body: dict[str, Any] = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    response = httpx.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=60)
    response.raise_for_status()
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")
