"""PAGEWIRE_EVENT_LOOP: which asyncio loop the services run on."""

from __future__ import annotations

import asyncio
import sys

import pytest

from pagewire_common import eventloop


async def loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_auto_runs_on_uvloop_when_installed(monkeypatch):
    pytest.importorskip("uvloop")
    monkeypatch.delenv("PAGEWIRE_EVENT_LOOP", raising=False)
    assert eventloop.run(loop_module()).startswith("uvloop")


def test_asyncio_forces_the_standard_loop(monkeypatch):
    monkeypatch.setenv("PAGEWIRE_EVENT_LOOP", "asyncio")
    assert eventloop.run(loop_module()).startswith("asyncio")


def test_auto_falls_back_without_uvloop_and_uvloop_demands_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    monkeypatch.setenv("PAGEWIRE_EVENT_LOOP", "auto")
    assert eventloop.run(loop_module()).startswith("asyncio")
    monkeypatch.setenv("PAGEWIRE_EVENT_LOOP", "uvloop")
    with pytest.raises(RuntimeError, match="uvloop is not installed"):
        eventloop.run(loop_module())


def test_unknown_choice_is_a_clear_error_and_leaves_no_stray_coroutine(monkeypatch):
    monkeypatch.setenv("PAGEWIRE_EVENT_LOOP", "tokio")
    main = loop_module()
    with pytest.raises(ValueError, match="auto, uvloop, asyncio"):
        eventloop.run(main)
    assert main.cr_frame is None  # closed: no "coroutine was never awaited" warning later
