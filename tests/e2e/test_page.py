"""The playground page at `/`, in a real browser against the session's `convoy serve`.

Debian's chromium (installed by `make test`) driven headless by Playwright; without it these
tests fail, never skip: Playwright's own browser download cannot work offline
(`CONVOY_CHROMIUM` names another binary). One browser for the module, a fresh context (its own
session storage: the key, the first-visit flag) a test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import (
    Browser,
    ConsoleMessage,
    Page,
    Request,
    expect,
    sync_playwright,
)

from tests.e2e.conftest import Server
from tests.e2e.helpers import API_KEY, MODEL

# NOTE: a closed network: no background fetches, updates or sync, which otherwise log errors.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
TIMEOUT_MS = 60_000  # a loaded 2-core machine runs the browser and the server together
FOUR_PROMPTS = ["The capital of France is", "def add(a, b):", "Water boils at", "My cat likes"]


def chromium_path() -> str:
    path = os.environ.get("CONVOY_CHROMIUM") or shutil.which("chromium")
    if path is None:
        pytest.fail("no chromium: `make test` installs Debian's (apt-get install -y chromium)")
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    expect.set_options(timeout=TIMEOUT_MS)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


class Tab:
    """A page in a fresh browser context, with what it sent and what went wrong in it."""

    def __init__(self, browser: Browser, server: Server, key: str | None, is_first_visit: bool):
        self.context = browser.new_context(base_url=server.base_url, accept_downloads=True)
        self.context.set_default_timeout(TIMEOUT_MS)
        storage = {} if key is None else {"convoy.apiKey": key}
        if not is_first_visit:
            storage["convoy.autostarted"] = "yes"
        # NOTE: what the page keeps in session storage, as a visit that set it earlier left it.
        self.context.add_init_script(
            f"for (const [k, v] of Object.entries({json.dumps(storage)})) sessionStorage.setItem(k, v);"
        )
        self.page: Page = self.context.new_page()
        self.posts: list[Request] = []
        self.js_errors: list[str] = []
        self.page.on("request", lambda r: self.posts.append(r) if r.method == "POST" else None)
        self.page.on("pageerror", lambda e: self.js_errors.append(str(e)))
        self.page.on("console", self._on_console)

    def _on_console(self, message: ConsoleMessage) -> None:
        # a CSP violation, say; an error status the server answered is what a test looks for
        if message.type == "error" and not message.text.startswith("Failed to load resource"):
            self.js_errors.append(message.text)

    def posts_to(self, path: str) -> list[dict[str, Any]]:
        return [json.loads(r.post_data or "") for r in self.posts if r.url.endswith(path)]


OpenTab = Callable[..., Tab]


@pytest.fixture
def open_tab(browser: Browser, server: Server) -> Iterator[OpenTab]:
    """`open_tab(view, key=API_KEY, is_first_visit=False)`: the page at `/#view` in a new tab."""
    tabs: list[Tab] = []

    def open_tab(view: str = "", key: str | None = API_KEY, is_first_visit: bool = False) -> Tab:
        tab = Tab(browser, server, key, is_first_visit)
        tabs.append(tab)
        tab.page.goto(f"/#{view}" if view else "/")
        return tab

    yield open_tab
    for tab in tabs:
        tab.context.close()
        assert tab.js_errors == []


def _greedy(http: httpx.Client, prompts: list[str], max_tokens: int) -> list[str]:
    body = {"model": MODEL, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0}
    return [c["text"] for c in http.post("/v1/completions", json=body).json()["choices"]]


def _fill_sampling(page: Page, prefix: str, **values: object) -> None:
    for name, value in values.items():
        page.fill(f"#{prefix}-{name}", str(value))


def test_the_page_and_its_files_need_no_key(server: Server) -> None:
    index = httpx.get(f"{server.base_url}/")
    assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in index.headers["content-security-policy"]
    for name in re.findall(r'"/page/([\w.]+)"', index.text):
        assert httpx.get(f"{server.base_url}/page/{name}").status_code == 200, name
    assert httpx.get(f"{server.base_url}/page/nope.js").status_code == 404
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 401  # the API still is not
    assert f"playground page: open {server.base_url}/ in a browser" in server.log()


def test_a_first_visit_streams_eight_prompts_at_once(open_tab: OpenTab) -> None:
    """A new user gives the key; the side-by-side view starts by itself: 8 prompts in one
    request, 8 panels streaming, the numbers panel showing tokens/s while they generate; Stop
    (or the end) leaves the server no sequence running."""
    tab = open_tab(key=None, is_first_visit=True)
    page = tab.page
    expect(page.locator("#key-error .message")).to_have_text("missing API key")
    page.fill("#api-key", API_KEY)
    page.click("#key-form button")
    # the numbers panel, reading /metrics every second, sees the tokens being generated
    page.wait_for_function("() => Number(document.getElementById('m-tps').dataset.value) > 0")
    expect(page.locator(".panel")).to_have_count(8)
    # every panel streams its own choice (sampled: one may end at once, on its EOS token)
    page.wait_for_function(
        "() => [...document.querySelectorAll('.panel')]"
        ".every((p) => Number(p.dataset.tokens) > 0 || p.dataset.finish)"
    )
    (body,) = tab.posts_to("/v1/completions")
    assert isinstance(body["prompt"], list) and len(body["prompt"]) == 8 and body["stream"]
    page.click("#batch-stop", force=True)  # a no-op if it is done already (Stop disabled)
    expect(page.locator("#batch-summary")).to_have_attribute(
        "data-state", re.compile("stopped|done")
    )
    expect(page.locator("#m-running")).to_have_text("0")


def test_four_prompts_stream_into_four_panels_from_one_request(
    open_tab: OpenTab, http: httpx.Client
) -> None:
    tab = open_tab()
    page = tab.page
    page.fill("#batch-count", "4")
    page.dispatch_event("#batch-count", "change")
    for i, prompt in enumerate(FOUR_PROMPTS):
        page.fill(f"#batch-prompt-{i}", prompt)
    _fill_sampling(page, "batch", max_tokens=8, temperature=0)
    page.click("#batch-generate")
    expect(page.locator("#batch-summary")).to_have_attribute("data-state", "done")
    (body,) = tab.posts_to("/v1/completions")
    assert body["prompt"] == FOUR_PROMPTS and body["stream"] is True
    panels = page.locator(".panel")
    expect(panels).to_have_count(4)
    # each panel shows its own choice: the texts the same prompts give without streaming
    expected = _greedy(http, FOUR_PROMPTS, 8)
    assert [panels.nth(i).locator(".out").text_content() for i in range(4)] == expected
    tokens = [int(panels.nth(i).get_attribute("data-tokens") or 0) for i in range(4)]
    assert all(t > 0 for t in tokens)
    for i in range(4):
        finish = panels.nth(i).get_attribute("data-finish")
        assert finish in ("length", "stop")
        expect(panels.nth(i).locator(".panel-foot")).to_have_text(
            f"{tokens[i]} tokens · finish: {finish}"
        )
    expect(page.locator("#batch-summary")).to_contain_text(f"+ {sum(tokens)} completion tokens")


def test_one_prompt_with_n_fills_a_panel_a_choice(open_tab: OpenTab) -> None:
    tab = open_tab()
    page = tab.page
    page.fill("#batch-count", "3")
    page.dispatch_event("#batch-count", "change")
    page.check("#batch-same")
    page.fill("#batch-prompt-0", "Once upon a time")
    _fill_sampling(page, "batch", max_tokens=4, temperature=1, seed=7)
    page.click("#batch-generate")
    expect(page.locator("#batch-summary")).to_have_attribute("data-state", "done")
    (body,) = tab.posts_to("/v1/completions")
    assert body["prompt"] == "Once upon a time" and body["n"] == 3
    for i in range(3):
        expect(page.locator(f'.panel[data-index="{i}"] .out')).not_to_be_empty()


def test_a_chat_message_streams_a_reply(open_tab: OpenTab, http: httpx.Client) -> None:
    tab = open_tab("chat")
    page = tab.page
    _fill_sampling(page, "chat", max_tokens=12, temperature=0)
    page.fill("#chat-input", "Name a colour.")
    page.press("#chat-input", "Enter")
    reply = page.locator(".msg.assistant")
    expect(reply).to_have_attribute("data-finish", re.compile("stop|length"))
    assert int(reply.get_attribute("data-chunks") or 0) >= 2  # arrived in pieces
    (body,) = tab.posts_to("/v1/chat/completions")
    assert body["stream"] is True and body["messages"][-1]["content"] == "Name a colour."
    plain = http.post(
        "/v1/chat/completions", json={**body, "stream": False, "stream_options": None}
    ).json()
    assert reply.locator(".text").text_content() == plain["choices"][0]["message"]["content"]


def test_chat_regex_mode_constrains_the_reply(open_tab: OpenTab) -> None:
    tab = open_tab("chat")
    page = tab.page
    _fill_sampling(page, "chat", max_tokens=24, temperature=0)
    page.select_option("#chat-mode", "regex")
    page.fill("#chat-spec", "(Yes|No)!")
    page.fill("#chat-input", "Is water wet?")
    page.click("#chat-send")
    reply = page.locator(".msg.assistant")
    expect(reply).to_have_attribute("data-finish", "stop")
    assert re.fullmatch(r"(Yes|No)!", reply.locator(".text").text_content() or "")
    (body,) = tab.posts_to("/v1/chat/completions")
    assert body["structured_outputs"] == {"regex": "(Yes|No)!"}


def test_server_errors_show_as_the_server_worded_them(
    open_tab: OpenTab, http: httpx.Client
) -> None:
    tab = open_tab("chat")
    page = tab.page
    page.fill("#chat-temperature", "-1")
    page.fill("#chat-input", "Hello")
    page.click("#chat-send")
    box = page.locator("#chat-error")
    expect(box).to_be_visible()
    (body,) = tab.posts_to("/v1/chat/completions")
    error = http.post("/v1/chat/completions", json=body).json()["error"]
    assert error["param"]
    expect(box.locator(".message")).to_have_text(error["message"])
    expect(box.locator(".param")).to_have_text(f"param: {error['param']}")
    expect(box.locator(".status")).to_have_text("400")
    expect(page.locator("#chat-input")).to_have_value("Hello")  # kept, to fix and send again


def test_a_bad_api_key_shows_the_401_message(open_tab: OpenTab, server: Server) -> None:
    wrong = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": "Bearer nope"})
    message = wrong.json()["error"]["message"]
    tab = open_tab(key="nope")
    page = tab.page
    expect(page.locator("#key-error .message")).to_have_text(message)
    expect(page.locator("#key-error .status")).to_have_text("401")
    page.click("#batch-generate")
    expect(page.locator("#batch-error .message")).to_have_text(message)
    expect(page.locator("#numbers-status")).to_have_text("needs the API key")


def test_a_batch_file_runs_to_completed_and_downloads(open_tab: OpenTab, tmp_path: Path) -> None:
    lines = [
        {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": f"Count to {i}:", "max_tokens": 4}}
        for i in range(10)
    ]  # fmt: skip
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tab = open_tab("jobs")
    page = tab.page
    page.set_input_files("#jobs-file", source)
    page.click("#jobs-start")
    expect(page.locator("#job-status")).to_have_text("completed")
    expect(page.locator("#job-counts")).to_have_text("10 completed, 0 failed of 10 lines")
    with page.expect_download() as download:
        page.click("#job-output")
    out = Path(download.value.path()).read_text().splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in out) == [f"line-{i}" for i in range(10)]
    assert all(json.loads(line)["response"]["status_code"] == 200 for line in out)


def test_a_running_batch_cancels(open_tab: OpenTab, tmp_path: Path) -> None:
    lines = [
        {"custom_id": f"long-{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 128,
                  "ignore_eos": True}}
        for i in range(100)
    ]  # fmt: skip
    source = tmp_path / "long.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    page = open_tab("jobs").page
    page.set_input_files("#jobs-file", source)
    page.click("#jobs-start")
    expect(page.locator("#job-cancel")).to_be_enabled()
    page.click("#job-cancel")
    expect(page.locator("#job-status")).to_have_text("cancelled")
    expect(page.locator("#job-cancel")).to_be_disabled()
    expect(page.locator("#jobs-list")).to_contain_text("cancelled")
