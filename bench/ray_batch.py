"""`convoy batch --ray` scaling on a local multi-node Ray cluster: 1 vs 2 vs 4 engine actors.

    python bench/ray_batch.py                       # both parts below
    python bench/ray_batch.py --part fake --fake-lines 3000
    python bench/ray_batch.py --part real --real-lines 200 --tokens 32

One `ray.cluster_utils.Cluster` on this host (a head with no CPUs and --nodes worker nodes of
--node-cpus logical CPUs each, loopback addresses only), and each job a `convoy batch --ray
ADDRESS` subprocess on it, every actor with --replica-cpus 1 (one torch thread):
  fake   the test engine (`--fake-engine 100:8`: 8 lines every 100 ms an actor, whatever the
         cores), --fake-lines lines: the scaling of the shard pipeline itself; goal >= 0.9 N
  real   the default model in fp32, --real-lines completions of --tokens tokens (EOS ignored),
         1 and 2 actors: the ratio needs a core per actor (pinned to one core it is ~1x)
"steady lines/s" counts the lines of shards that finished once every actor had finished one
(its engine loaded and its first shard done) over the time to the last shard: start-up (Ray
workers, imports, model loads) is left out, and shown apart as "whole command".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray: loopback only

from ray.cluster_utils import Cluster  # noqa: E402

from prompts import make_prompts  # noqa: E402

MODEL = "smollm2-135m-instruct"
FAKE = "100:8"


def write_input(path: Path, num: int, tokens: int) -> None:
    rows = []
    for k, prompt in enumerate(make_prompts(num)):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        rows.append({"custom_id": f"line-{k}", "method": "POST", "url": "/v1/completions",
                     "body": body})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_job(
    folder: Path, address: str, actors: int, shard_lines: int, engine: list[str]
) -> dict[str, Any]:
    """Run one job; its whole-command seconds and steady lines/s (see the module docstring)."""
    inp, out, calls = (
        folder / "in.jsonl",
        folder / f"out-{actors}.jsonl",
        folder / f"calls-{actors}",
    )
    calls.mkdir()
    cmd = [
        sys.executable, "-m", "convoy.cli", "batch", "-i", str(inp), "-o", str(out),
        "--ray", address, "--replicas", str(actors), "--replica-cpus", "1",
        "--shard-lines", str(shard_lines), "--log-level", "warning", *engine,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CONVOY_TEST_SHARD_CALLS": str(calls)}
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    whole_s = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"convoy batch exited {done.returncode}:\n{done.stderr[-3000:]}")
    # Each shard: the actor (pid) that ran it, when its part file was written, its lines.
    parts = out.with_name(out.name + ".convoy-shards")
    shards = []
    for part in parts.iterdir():
        pids = (calls / part.stem).read_text().split()
        assert len(pids) == 1, f"{part.stem} ran {len(pids)} times"
        shards.append((part.stat().st_mtime, pids[0], len(part.read_text().splitlines())))
    shards.sort()
    first_done: dict[str, float] = {}
    for finished, pid, _ in shards:
        first_done.setdefault(pid, finished)
    assert len(first_done) == actors, f"{len(first_done)} of {actors} actors answered"
    warm = max(first_done.values())
    after = [(t, n) for t, _, n in shards if t > warm]
    steady = sum(n for _, n in after) / (after[-1][0] - warm) if after else float("nan")
    return {"whole_s": whole_s, "steady": steady, "steady_lines": sum(n for _, n in after)}


def measure(cluster: Cluster, name: str, counts: list[int], lines: int, tokens: int,
            shard_lines: int, engine: list[str]) -> list[str]:  # fmt: skip
    rows, base = [], None
    for actors in counts:
        with tempfile.TemporaryDirectory(prefix="convoy-ray-bench-") as tmp:
            folder = Path(tmp)
            write_input(folder / "in.jsonl", lines, tokens)
            result = run_job(folder, cluster.address, actors, shard_lines, engine)
        base = base or result["steady"]
        scaling = result["steady"] / base
        goal = f"{'ok' if scaling >= 0.9 * actors else 'MISSED'} (>= {0.9 * actors:.1f})"
        goal = goal if name == "fake" else "-"
        rows.append(
            f"| {name} | {actors} | {lines} | {result['steady']:.1f}"
            f" ({result['steady_lines']} lines) | {scaling:.2f}x | {goal}"
            f" | {result['whole_s']:.1f} |"
        )
        print(rows[-1], file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("fake", "real", "both"), default="both")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--node-cpus", type=int, default=2, help="logical CPUs a worker node")
    parser.add_argument("--fake-lines", type=int, default=3000)
    parser.add_argument("--real-lines", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    rows = []
    try:
        for _ in range(args.nodes):
            cluster.add_node(num_cpus=args.node_cpus)
        cluster.wait_for_nodes()
        if args.part in ("fake", "both"):
            engine = [MODEL, "--fake-engine", FAKE]
            rows += measure(cluster, "fake", [1, 2, 4], args.fake_lines, 1, 64, engine)
        if args.part in ("real", "both"):
            engine = [MODEL, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "128MiB"]
            rows += measure(cluster, "real", [1, 2], args.real_lines, args.tokens, 25, engine)
    finally:
        cluster.shutdown()
    print(f"\n{args.nodes} worker nodes x {args.node_cpus} logical CPUs, 1 CPU (thread) an actor\n")
    print("| engine | actors | lines | steady lines/s | vs 1 actor | goal | whole command s |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
