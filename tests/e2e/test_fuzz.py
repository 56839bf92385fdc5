"""Schemathesis against a real server: a seeded run of 250+ cases generated from /openapi.json
(valid and invalid bodies for the generation routes, /v1/responses among them, and the
tokenizer's). No case may get a 5xx, a non-OpenAI error, a broken stream or no answer; afterwards
the server serves a normal request and every KV block is free. bench/fuzz.py runs the same for 10,000+ cases."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import Server, start_server, stop_server
from tests.e2e.fuzzing import FUZZ_THREADS, SERVE_ARGS, check_after_fuzzing, fuzz

NUM_CASES = 250
SEED = 20240610


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with pytest.MonkeyPatch.context() as env:  # the server process inherits it
        env.setenv("OMP_NUM_THREADS", str(FUZZ_THREADS))
        server = start_server(SERVE_ARGS, tmp_path_factory.mktemp("fuzz"))
    try:
        yield server
    finally:
        stop_server(server)


def test_fuzzed_requests_never_break_the_server(fuzz_server: Server) -> None:
    report = fuzz(fuzz_server.base_url, fuzz_server.headers, NUM_CASES, SEED)
    print(report.table())
    assert report.num_cases >= NUM_CASES
    assert not report.failures, "\n".join(report.failures[:20])
    assert any(key.endswith(" 200") for key in report.statuses)  # valid cases were served too
    check_after_fuzzing(fuzz_server.base_url, fuzz_server.headers)
    fuzz_server.wait_for_metric("convoy_kv_blocks_used", 0)
    fuzz_server.wait_for_metric("convoy_engine_requests_in_flight", 0)
