"""`convoy serve` names uvicorn's event loop and HTTP parser, so installing the ray extra (which
brings uvloop and httptools, uvicorn[standard]) does not change the single-machine server."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from convoy.cli import parse_serve_args, uvicorn_options


async def _app(scope: object, receive: object, send: object) -> None:
    raise AssertionError("not called: only the config is loaded")


def _config(**overrides: str) -> uvicorn.Config:
    options = {**uvicorn_options(parse_serve_args([])), **overrides}
    config = uvicorn.Config(_app, **options)
    config.load()
    return config


def _loop_type(config: uvicorn.Config) -> type:
    factory = config.get_loop_factory()
    loop = factory() if factory is not None else asyncio.new_event_loop()
    try:
        return type(loop)
    finally:
        loop.close()


def test_serve_runs_asyncio_and_h11_whatever_is_installed() -> None:
    config = _config()
    assert config.http_protocol_class is H11Protocol
    assert _loop_type(config).__module__.startswith("asyncio")


def test_the_pin_matters_where_uvloop_and_httptools_are_installed() -> None:
    """What "auto" would pick with the ray extra installed: the reason for the pin."""
    if not (importlib.util.find_spec("uvloop") and importlib.util.find_spec("httptools")):
        pytest.skip("uvloop and httptools are not installed (no ray extra): auto is asyncio/h11")
    config = _config(loop="auto", http="auto")
    assert config.http_protocol_class is not H11Protocol
    assert _loop_type(config).__module__.startswith("uvloop")
