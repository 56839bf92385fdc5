"""The API key: where `convoy serve` reads it from, and how the middleware checks it."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from convoy.api.middleware import APIKeyMiddleware
from convoy.cli import parse_serve_args

KEY = "sk-test-key"


@pytest.fixture(autouse=True)
def _env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVOY_API_KEY", "from-env")


def test_key_file_wins_over_the_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(f"  {KEY}\n")
    assert parse_serve_args(["--api-key-file", str(key_file)]).api_key == KEY
    assert parse_serve_args([]).api_key == "from-env"
    assert parse_serve_args(["--api-key", "flag"]).api_key == "flag"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--api-key", "k", "--api-key-file", "{file}"], "not both"),
        (["--api-key-file", "{missing}"], "cannot read"),
        (["--api-key-file", "{empty}"], "is empty"),
    ],
)
def test_bad_key_files_exit(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "key").write_text(KEY)
    (tmp_path / "empty").write_text("\n")
    paths = {"file": tmp_path / "key", "missing": tmp_path / "nope", "empty": tmp_path / "empty"}
    with pytest.raises(SystemExit):
        parse_serve_args([arg.format(**paths) for arg in argv])
    err = capsys.readouterr().err
    assert message in err and KEY not in err


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    app.add_middleware(APIKeyMiddleware, api_key=KEY)

    @app.get("/v1/models")
    async def models() -> dict[str, str]:
        return {"ok": "yes"}

    return TestClient(app)


@pytest.mark.parametrize("header", [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER  {KEY}"])
def test_the_bearer_scheme_is_case_insensitive(client: TestClient, header: str) -> None:
    assert client.get("/v1/models", headers={"Authorization": header}).status_code == 200


@pytest.mark.parametrize(
    "header", ["", KEY, f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer", "Bearer "]
)
def test_anything_else_is_401(client: TestClient, header: str) -> None:
    response = client.get("/v1/models", headers={"Authorization": header} if header else {})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert KEY not in response.text


@pytest.fixture(scope="module")
def page_client() -> TestClient:
    app = FastAPI()
    app.add_middleware(APIKeyMiddleware, api_key=KEY)

    @app.get("/{path:path}")
    async def anything(path: str) -> dict[str, str]:
        return {"path": path}

    return TestClient(app)


@pytest.mark.parametrize("path", ["/", "/page/app.js", "/page/index.html", "/health"])
def test_the_page_is_public(page_client: TestClient, path: str) -> None:
    assert page_client.get(path).status_code == 200


@pytest.mark.parametrize(
    "path", ["/page", "/page/", "/pages/app.js", "/page/sub/app.js", "/metrics"]
)
def test_nothing_else_is(page_client: TestClient, path: str) -> None:
    assert page_client.get(path).status_code == 401
