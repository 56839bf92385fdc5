"""The Batch API's job engine: data folder, ledger, runner, executor, offline runs; no routes."""
