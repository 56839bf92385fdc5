"""Long schemathesis run against a real server: the same fuzzing as tests/e2e/test_fuzz.py, longer.

    .venv/bin/python bench/fuzz.py                    # 10,000 cases, seed 0
    .venv/bin/python bench/fuzz.py --cases 2000 --seed 7

Starts `convoy serve` with the fuzzing limits (tests/e2e/fuzzing.py: SERVE_ARGS; one torch thread
so a busy neighbour on a shared machine slows it gracefully), sends --cases cases generated from
its /openapi.json (valid and invalid bodies for /v1/completions, /v1/chat/completions, /tokenize,
/detokenize), then checks that a normal request is served and no KV block is left in use. Prints
the count of every route and status, the failures (5xx, a server_error frame, a non-OpenAI error
body, a broken stream, no answer in 30 s) and the slowest cases; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: tests.e2e

from tests.e2e.conftest import start_server, stop_server  # noqa: E402
from tests.e2e.fuzzing import FUZZ_THREADS, SERVE_ARGS, check_after_fuzzing, fuzz  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=10_000, help="cases in all (default 10000)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(FUZZ_THREADS)  # the server inherits it
    server = start_server(SERVE_ARGS, Path(tempfile.mkdtemp(prefix="convoy-fuzz-")))
    try:
        start = time.monotonic()
        report = fuzz(server.base_url, server.headers, args.cases, args.seed)
        wall = time.monotonic() - start
        check_after_fuzzing(server.base_url, server.headers)
        server.wait_for_metric("convoy_kv_blocks_used", 0)
        server.wait_for_metric("convoy_engine_requests_in_flight", 0)
    finally:
        stop_server(server)
    print(report.table())
    print(f"{wall:.0f}s wall for {report.num_cases} cases (seed {args.seed}); after the run a")
    print("normal request was served and KV blocks in use were back to 0")
    for failure in report.failures:
        print("FAIL", failure)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
