"""The console's terminal driver: its input thread reads keys as Textual's does, and stops at
once (issue 36 point 14: a quit spent 0.2 s of its 0.22 s waiting for Textual's to stop)."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import pytest
from textual import events
from textual.app import App

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the Linux/macOS driver")


def started(driver_class: type[Any]) -> tuple[Any, list[events.Event], int]:
    """A driver reading keys from a pipe (as from the terminal), its input thread running."""
    driver = driver_class(App())
    read_end, write_end = os.pipe()
    driver.fileno = read_end
    driver._disable_mouse_support = lambda: None  # (no terminal to write to)
    got: list[events.Event] = []
    driver.process_message = got.append
    driver._key_thread = threading.Thread(target=driver._run_input_thread, daemon=True)
    driver._key_thread.start()
    return driver, got, write_end


def stop_time(driver: Any) -> float:
    t0 = time.monotonic()
    driver.disable_input()
    assert driver._key_thread is not None and not driver._key_thread.is_alive()
    return time.monotonic() - t0


async def test_the_input_thread_reads_keys_and_stops_at_once() -> None:
    from textual.drivers.linux_driver import LinuxDriver

    from swarm_tui.app.app import SwarmApp
    from swarm_tui.app.driver import QuickExitDriver
    from tests.tui_support import FakeClient

    assert App().driver_class is LinuxDriver  # (Textual's, on this platform)
    assert SwarmApp(FakeClient()).driver_class is QuickExitDriver
    driver, got, keys = started(QuickExitDriver)
    try:
        os.write(keys, b"a5\x7f")
        deadline = time.monotonic() + 5
        while len([e for e in got if isinstance(e, events.Key)]) < 3:
            assert time.monotonic() < deadline, got
            time.sleep(0.01)
        assert [e.key for e in got if isinstance(e, events.Key)] == ["a", "5", "backspace"]
        time.sleep(0.05)  # (the thread back in its wait)
        assert stop_time(driver) < 0.05
        # Started again (after a suspend): the wake left behind does not spin it.
        driver._key_thread = threading.Thread(target=driver._run_input_thread, daemon=True)
        driver._key_thread.start()
        time.sleep(0.25)
        assert driver._key_thread.is_alive()
        os.write(keys, b"b")
        deadline = time.monotonic() + 5
        while not any(isinstance(e, events.Key) and e.key == "b" for e in got):
            assert time.monotonic() < deadline, got
            time.sleep(0.01)
        assert stop_time(driver) < 0.05
    finally:
        os.close(keys)
        driver.close()
    # Textual's own waits about 0.2 s (0.1 s for its wait, 0.1 s on an emptied selector).
    base, _got, keys = started(LinuxDriver)
    try:
        time.sleep(0.05)
        assert stop_time(base) >= 0.1
    finally:
        os.close(keys)
