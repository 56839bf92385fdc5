"""A/B of two source trees: each side's own bench/throughput.py and bench/serve.py, interleaved.

    python bench/ab.py --before /tmp/before                 # after = this repo's root
    python bench/ab.py --before /tmp/before --rounds 2 --models smollm2-135m-instruct \\
        --dtypes float32 --batches 1,16 --tokens 64

Make the old tree with `git worktree add /tmp/before <commit>`. Every run uses this interpreter
(sys.executable, same venv) with cwd = that side's root and PYTHONPATH = <side>/src, checked to win
over the venv's editable install before anything runs; serve.py's server inherits that env. Each
side gets its own TORCH_EXTENSIONS_DIR, so the two trees' CPU kernels never overwrite each other.
Order per round: throughput before, after, serve before, after. throughput.py runs with
--skip-baselines, serve.py with its own options; both with --repeats (3). Prints one markdown table:
median (min-max) per side (over rounds: median of the runs' medians, overall min and max), the
after/before ratio of medians, and a flag when it is outside [1 - tol, 1 + tol]. Exit status 1 when
a row is flagged or missing on one side. Children's stderr (progress) streams through.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
Stats = tuple[float, float, float, str]  # median, min, max, others' CPU (throughput.py only)
MED_RANGE = re.compile(r"^\s*([\d.]+)\s*\(([\d.]+)-([\d.]+)\)")


def log(msg: str) -> None:
    print(f"[ab] {msg}", file=sys.stderr, flush=True)


def side_env(root: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(root / "src"))
    base = os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    tag = hashlib.sha256(str(root).encode()).hexdigest()[:8]
    env["TORCH_EXTENSIONS_DIR"] = str(Path(base) / f"ab-{root.name}-{tag}")
    return env


def check_side(name: str, root: Path) -> None:
    """Fail loudly unless `import convoy` in that env resolves to <root>/src (not the venv's)."""
    for script in ("throughput.py", "serve.py", "prompts.py"):
        if not (root / "bench" / script).is_file():
            sys.exit(f"[ab] {name}: {root / 'bench' / script} is missing")
    code = "import convoy; print(convoy.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=side_env(root), capture_output=True, text=True
    )
    got = Path(out.stdout.strip() or "?").resolve()
    if out.returncode != 0 or not got.is_relative_to(root / "src"):
        sys.exit(f"[ab] {name}: convoy resolves to {got}, not {root / 'src'}\n{out.stderr}")
    log(f"{name}: convoy -> {got}")


def run(name: str, root: Path, args: list[str], commands: list[str]) -> str:
    """Run one bench script of one side; stream its stdout (to stderr) and stderr; return stdout."""
    env = side_env(root)
    cmd = [sys.executable, *args]
    shown = (
        f"cd {shlex.quote(str(root))} && PYTHONPATH={shlex.quote(env['PYTHONPATH'])} "
        f"TORCH_EXTENSIONS_DIR={shlex.quote(env['TORCH_EXTENSIONS_DIR'])} {shlex.join(cmd)}"
    )
    commands.append(shown)
    log(f"{name}: {shown}")
    t0 = time.perf_counter()
    with subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            print(f"  | {line}", end="", file=sys.stderr, flush=True)
    if proc.returncode != 0:
        sys.exit(f"[ab] {name}: exit status {proc.returncode}: {shown}")
    log(f"{name}: done in {time.perf_counter() - t0:.1f}s")
    return "".join(lines)


def tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """Markdown tables in `text`: (last non-table line before it, header cells, data rows)."""
    found, caption, block = [], "", []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if len(block) >= 2:
            found.append((caption, block[0], block[2:]))
        block = []
        caption = line.strip() or caption
    return found


def parse(text: str) -> dict[str, Stats]:
    """Rows of throughput.py's and serve.py's tables as {key: (median, min, max, others)}."""
    out: dict[str, Stats] = {}
    for caption, head, rows in tables(text):
        col = {h: i for i, h in enumerate(head)}
        conv = next((i for i, h in enumerate(head) if h.startswith("convoy tok/s")), None)
        if conv is not None:  # throughput.py
            for r in rows:
                if m := MED_RANGE.match(r[conv]):
                    key = f"throughput {r[col['model']]} {r[col['dtype']]} B={r[col['B']]}"
                    others = r[col["others' CPU"]] if "others' CPU" in col else "?"
                    out[key] = (float(m[1]), float(m[2]), float(m[3]), others)
        elif {"path", "min", "median", "max"} <= col.keys():  # serve.py
            what = " ".join(caption.split(":")[0].split()[:2])  # "<model> <dtype>"
            for r in rows:
                med, lo, hi = (float(r[col[c]]) for c in ("median", "min", "max"))
                out[f"serve {what} {r[col['path']]}"] = (med, lo, hi, "")
    return out


def combine(runs: list[Stats]) -> Stats:
    meds, los, his, cpus = zip(*runs, strict=True)
    return statistics.median(meds), min(los), max(his), ",".join(c for c in cpus if c)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="old tree (a git worktree)")
    p.add_argument("--after", type=Path, default=ROOT, help=f"new tree (default {ROOT})")
    p.add_argument("--rounds", type=int, default=1, help="repeat the whole interleaved sequence")
    p.add_argument("--repeats", type=int, default=3, help="--repeats for every script call")
    p.add_argument("--tolerance", type=float, default=0.10, help="flag ratios outside 1 +- this")
    p.add_argument("--benches", default="throughput,serve", help="throughput,serve or one of them")
    for opt in ("--models", "--dtypes", "--batches", "--tokens", "--wait-idle"):
        p.add_argument(opt, help=f"throughput.py {opt}")
    for opt in ("model", "dtype", "prompts", "tokens"):
        p.add_argument(f"--serve-{opt}", help=f"serve.py --{opt}")
    a = p.parse_args()
    sides = {"before": a.before.resolve(), "after": a.after.resolve()}
    benches = [b for b in a.benches.split(",") if b]
    if bad := set(benches) - {"throughput", "serve"}:
        p.error(f"unknown bench(es) {sorted(bad)}")

    def opts(prefix: str, names: tuple[str, ...]) -> list[str]:
        vals = ((n, getattr(a, prefix + n.replace("-", "_"))) for n in names)
        return [x for n, v in vals if v is not None for x in (f"--{n}", v)]

    argv = {
        "throughput": ["bench/throughput.py", "--skip-baselines", "--repeats", str(a.repeats)]
        + opts("", ("models", "dtypes", "batches", "tokens", "wait-idle")),
        "serve": ["bench/serve.py", "--repeats", str(a.repeats)]
        + opts("serve_", ("model", "dtype", "prompts", "tokens")),
    }
    start = time.perf_counter()
    for name, root in sides.items():
        check_side(name, root)
    commands: list[str] = []
    results: dict[str, dict[str, list[Stats]]] = {"before": {}, "after": {}}
    for rnd in range(a.rounds):
        for bench in benches:
            for name, root in sides.items():
                log(f"round {rnd + 1}/{a.rounds}: {bench} {name}")
                stdout = run(f"{bench} {name}", root, argv[bench], commands)
                parsed = parse(stdout)
                if not parsed:
                    sys.exit(f"[ab] no result table found in {bench} {name}'s stdout")
                for key, stats in parsed.items():
                    results[name].setdefault(key, []).append(stats)

    def cell(runs: list[Stats] | None) -> str:
        return "-" if not runs else "{:.1f} ({:.1f}-{:.1f})".format(*combine(runs)[:3])

    lo, hi = 1 - a.tolerance, 1 + a.tolerance
    print(f"\n## A/B: before {sides['before']} vs after {sides['after']}\n")
    print(f"tok/s, median (min-max) of {a.repeats} repeats x {a.rounds} round(s) per side\n")
    print("| row | before | after | after/before | flag | others' CPU before / after |")
    print("|---|---|---|---|---|---|")
    flagged = 0
    for key in dict.fromkeys([*results["before"], *results["after"]]):
        b, f = results["before"].get(key), results["after"].get(key)
        r = combine(f)[0] / combine(b)[0] if b and f and combine(b)[0] else None
        flag = "" if r is not None and lo <= r <= hi else f"OUTSIDE [{lo:.2f}, {hi:.2f}]"
        flag = "MISSING" if r is None else flag
        flagged += bool(flag)
        cpu = (
            " / ".join(combine(x)[3] if x else "-" for x in (b, f))
            if key.startswith("thr")
            else "-"
        )
        print(
            f"| {key} | {cell(b)} | {cell(f)} | {'-' if r is None else f'{r:.3f}'} | {flag} | {cpu} |"
        )
    print(f"\n{flagged} row(s) flagged. Trust a ratio only where others' CPU (throughput.py: other")
    print("processes' share of all CPUs while measuring) is low on both sides. Commands run:\n")
    print("\n".join(f"    {c}" for c in commands))
    print(f"\nTotal wall time: {time.perf_counter() - start:.1f}s")
    sys.exit(1 if flagged else 0)


if __name__ == "__main__":
    main()
