"""Screenshots of the playground page's views for the README: docs/page-{batch,chat,jobs}.png.

    python bench/page_screenshots.py                 # starts `convoy serve` (default model)
    python bench/page_screenshots.py --url http://127.0.0.1:8000 [--api-key KEY]

Drives Debian's chromium headless through Playwright, as tests/e2e/test_page.py does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from playwright.sync_api import Page, expect, sync_playwright

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
VIEWPORT = {"width": 1280, "height": 860}
TIMEOUT_MS = 180_000


@contextlib.contextmanager
def served(url: str | None) -> Iterator[str]:
    """`url`, or a `convoy serve` of the default model started for the screenshots."""
    if url:
        yield url.rstrip("/")
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as data:
        cmd = [sys.executable, "-m", "convoy.cli", "serve", "--port", str(port), "--data-dir", data]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while not _is_healthy(base):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"convoy serve did not start: {' '.join(cmd)}")
                time.sleep(0.5)  # polling while the model loads
            yield base
        finally:
            proc.terminate()
            proc.wait(60)


def _is_healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def warm_up(base: str, key: str) -> None:
    """One small batched request first: a fresh server's first steps are slower than the rest."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    model = httpx.get(f"{base}/v1/models", headers=headers).json()["data"][0]["id"]
    body = {"model": model, "prompt": ["Hello"] * 8, "max_tokens": 16}
    httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=300)


def shoot_batch(page: Page, out: Path) -> None:
    page.goto("/")  # a first visit: the 8 default prompts start by themselves
    expect(page.locator("#batch-summary")).to_have_attribute("data-state", "done")
    page.screenshot(path=out / "page-batch.png")


def shoot_chat(page: Page, out: Path) -> None:
    page.goto("/#chat")
    page.fill("#chat-system", "You are a concise assistant.")
    page.fill("#chat-max_tokens", "80")
    for message in ["What is continuous batching, in one sentence?", "Give me a city as JSON."]:
        if message.endswith("JSON."):
            page.select_option("#chat-mode", "json")
        page.fill("#chat-input", message)
        page.click("#chat-send")
        expect(page.locator(".msg.assistant").last).to_have_attribute(
            "data-finish", re.compile(".+")
        )
    page.screenshot(path=out / "page-chat.png")


def shoot_jobs(page: Page, out: Path) -> None:
    page.goto("/#jobs")
    page.click("#jobs-sample")
    expect(page.locator("#job-status")).to_have_text("completed")
    page.screenshot(path=out / "page-jobs.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--api-key", default="", help="the server's key, if it has one")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    expect.set_options(timeout=TIMEOUT_MS)
    with served(args.url) as base, sync_playwright() as p:
        warm_up(base, args.api_key)
        browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
        context = browser.new_context(base_url=base, viewport=VIEWPORT)  # type: ignore[arg-type]
        key = json.dumps(args.api_key)
        context.add_init_script(f"if ({key}) sessionStorage.setItem('convoy.apiKey', {key});")
        page = context.new_page()
        for shoot in (shoot_batch, shoot_chat, shoot_jobs):
            shoot(page, args.out)
        browser.close()
    for name in ("page-batch.png", "page-chat.png", "page-jobs.png"):
        print(f"{args.out / name}: {(args.out / name).stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
