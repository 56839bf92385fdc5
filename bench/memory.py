"""Resident memory of a loaded GGUF model against the file's size (issue #9: a Q4 GGUF's weights
held in <= 1.3x the file), the quantized mode (quantization gguf) beside the fp32 mode.

    python bench/memory.py                        # both embedded models, both modes, 3 runs each
    python bench/memory.py --models smollm2-135m-instruct --modes quantized --repeat 1

Each measurement is a fresh subprocess: it imports torch and Convoy, reads VmRSS from
/proc/self/status ("before"), builds the Worker (model, kernels, a 16-block KV cache: the
weights dominate) and reads VmRSS again ("after"; RSS counts everything, mapped file pages
included) and VmHWM (the peak). ratio = (after - before) / GGUF file size. Caches (converted
folder with its fp32 safetensors, compiled kernels) are filled beforehand, outside the
measurement. The table shows the median of --repeat runs with [min, max], and the load time
(the Worker's construction: warm, the file in the page cache; `--cold` drops the page cache
before each run, root only). Any .gguf path works as a model (bench/synth_gguf.py writes real
sizes); only the fp32 mode converts it to fp32 safetensors first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODELS = ("smollm2-135m-instruct", "gemma3-270m")
MODES = {  # mode -> engine keywords
    "quantized": {"quantization": "gguf"},  # the GGUF's blocks kept, fp32 activations
    "fp32": {"dtype": "float32", "quantization": "none"},  # dequantized (the exact mode)
}
LIMIT = 1.3  # issue #9: weights of a Q4 GGUF in <= 1.3x the file
MB = 1e6


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def child(model: str, mode: str) -> None:
    """One measurement in this (fresh) process; prints one JSON line."""
    from convoy.config import EngineConfig
    from convoy.models.resolve import resolve_model
    from convoy.worker.worker import Worker

    file_size = resolve_model(model).weights_path.stat().st_size
    before = _status_kb("VmRSS")
    start = time.monotonic()
    worker = Worker(EngineConfig.from_kwargs(model=model, num_kv_blocks=16, **MODES[mode]))
    seconds = time.monotonic() - start
    after, peak = _status_kb("VmRSS"), _status_kb("VmHWM")
    row = {
        "file": file_size,
        "before": before,
        "after": after,
        "peak": peak,
        "seconds": seconds,
        "quantized_linears": worker.quantized_linears,
    }
    print(json.dumps(row))


def _prepare(model: str, modes: list[str]) -> None:
    """Fill the caches a first start fills (the kernels; the fp32 safetensors only when the fp32
    mode runs: a 7B's are 28 GB), in a subprocess."""
    code = (
        "import sys; from convoy import kernels; from convoy.models.resolve import "
        "ensure_hf_weights, resolve_model; kernels.available(); r = resolve_model(sys.argv[1]); "
        "sys.argv[2] == '1' and ensure_hf_weights(r)"
    )
    fp32 = "1" if "fp32" in modes else "0"
    subprocess.run([sys.executable, "-c", code, model, fp32], check=True)


def _drop_page_cache() -> bool:
    """Empty the kernel's page cache (root only) so the next load reads the file from disk."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _measure(model: str, mode: str, cold: bool) -> dict[str, float]:
    if cold and not _drop_page_cache():
        sys.exit("--cold: cannot write /proc/sys/vm/drop_caches (needs root)")
    out = subprocess.run(
        [sys.executable, __file__, "--child", model, mode],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _spread(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} [{format(min(values), fmt)}, {format(max(values), fmt)}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--cold", action="store_true", help="drop the page cache before each load (root only)"
    )
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    header = (
        f"{'model':<22} {'mode':<9} {'GGUF MB':>8} {'RSS before MB':>14} {'RSS after MB':>13} "
        f"{'delta MB':>20} {'delta/file':>20} {'peak/file':>9} {'<=1.3x':>6} {'quant':>5} {'load s':>16}"
    )
    print(header)
    print("-" * len(header))
    for model in args.models.split(","):
        modes = args.modes.split(",")
        _prepare(model, modes)
        for mode in modes:
            runs = [_measure(model, mode, args.cold) for _ in range(args.repeat)]
            size = runs[0]["file"]
            deltas = [(r["after"] - r["before"]) / MB for r in runs]
            ratios = [(r["after"] - r["before"]) / size for r in runs]
            peaks = [(r["peak"] - r["before"]) / size for r in runs]
            print(
                f"{model:<22} {mode:<9} {size / MB:>8.1f} "
                f"{statistics.median(r['before'] for r in runs) / MB:>14.1f} "
                f"{statistics.median(r['after'] for r in runs) / MB:>13.1f} "
                f"{_spread(deltas, '.1f'):>20} {_spread(ratios, '.2f'):>20} "
                f"{statistics.median(peaks):>9.2f} "
                f"{'yes' if statistics.median(ratios) <= LIMIT else 'no':>6} "
                f"{runs[0]['quantized_linears']:>5} "
                f"{_spread([r['seconds'] for r in runs], '.1f'):>16}",
                flush=True,
            )


if __name__ == "__main__":
    main()
