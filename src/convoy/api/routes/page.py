"""The playground page: `GET /` and its static files under `/page/` (api/page/, in the wheel).

Plain HTML, CSS and JavaScript, no build step and nothing fetched from elsewhere, so it works
offline. These routes are public (middleware.PUBLIC_PATHS / PUBLIC_FOLDERS): the page holds no
secret; it asks for the API key and sends it on every API call it makes.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

from convoy.api.errors import APIError

PAGE_DIR = Path(__file__).resolve().parent.parent / "page"
PAGE_PREFIX = "/page/"
_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
# NOTE: the page shows model output and server errors: a strict policy means no script but
# the page's own runs, and it talks to this server alone.
_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; img-src 'self'; style-src 'self'; script-src 'self';"
        " connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "cache-control": "no-cache",
    "referrer-policy": "no-referrer",
}


def page_files(folder: Path = PAGE_DIR) -> dict[str, tuple[bytes, str]]:
    """Every servable file of the page folder by name: its bytes and media type."""
    return {
        path.name: (path.read_bytes(), _MEDIA_TYPES[path.suffix])
        for path in sorted(folder.iterdir())
        if path.suffix in _MEDIA_TYPES
    }


def add_page_routes(app: FastAPI) -> None:
    """`/` (index.html) and `/page/{name}`; the files are read once, when the app is built."""
    files = page_files()

    def answer(name: str) -> Response:
        if name not in files:
            raise APIError(404, f"no page file named {name!r}", code="not_found")
        body, media_type = files[name]
        return Response(body, media_type=media_type, headers=_HEADERS)

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return answer("index.html")

    @app.get(PAGE_PREFIX + "{name}", include_in_schema=False)
    async def page_file(name: str) -> Response:
        return answer(name)


def page_url(host: str, port: int) -> str:
    """Where a browser on this machine finds the page of a server bound to `host`:`port`."""
    if host in ("", "0.0.0.0", "::"):  # every interface: this machine's loopback is one of them
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/"
