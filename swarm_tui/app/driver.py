"""The console's terminal driver on Linux and macOS: Textual's, with an input thread that stops
at once.

Textual's ``LinuxDriver`` stops its input thread by setting an event the thread looks at
between 0.1 s waits for input, then waits another 0.1 s on a selector it has just emptied: a
quit spent 0.2 s there, of 0.22 s in all (issue 36 point 14: quit < 1 s). Here a pipe wakes
the thread's wait, and the last read of what is left does not wait. Everything else is
Textual's. ``run_input_thread`` is Textual 8.2.8's (pinned exactly, as ``LiveTable``'s
internals are), changed only where marked.
"""

from __future__ import annotations

import contextlib
import os
import selectors
from codecs import getincrementaldecoder
from typing import Any

from textual._loop import loop_last
from textual._parser import ParseError
from textual._xterm_parser import XTermParser
from textual.drivers.linux_driver import LinuxDriver


class QuickExitDriver(LinuxDriver):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def disable_input(self) -> None:
        with contextlib.suppress(OSError):  # (full: a wake is pending anyway)
            os.write(self._wake_w, b"x")
        super().disable_input()

    def close(self) -> None:
        super().close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(self._wake_r, 512):
                pass

    def run_input_thread(self) -> None:
        """Wait for input and dispatch events."""
        selector = selectors.SelectSelector()
        selector.register(self.fileno, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)  # (ours: the wake)
        self._drain_wake()  # (ours: a wake left from the thread before, after a suspend)

        fileno = self.fileno
        EVENT_READ = selectors.EVENT_READ

        parser = XTermParser(self._debug)
        feed = parser.feed
        tick = parser.tick

        utf8_decoder = getincrementaldecoder("utf-8")().decode
        decode = utf8_decoder
        read = os.read

        def process_selector_events(
            selector_events: list[tuple[selectors.SelectorKey, int]],
            final: bool = False,
        ) -> None:
            # (ours: the wake is no input)
            selector_events = [(k, m) for k, m in selector_events if k.fd == fileno]
            for last, (_selector_key, mask) in loop_last(selector_events):
                if mask & EVENT_READ:
                    unicode_data = decode(read(fileno, 1024 * 4), final=final and last)
                    if not unicode_data:
                        # This can occur if the stdin is piped
                        break
                    for event in feed(unicode_data):
                        self.process_message(event)
            for event in tick():
                self.process_message(event)

        try:
            while not self.exit_event.is_set():
                process_selector_events(selector.select(0.1))
            self._drain_wake()  # (ours)
            selector.unregister(self._wake_r)  # (ours)
            selector.unregister(self.fileno)
            # (ours: select(0), not 0.1: on the selector just emptied it only waited)
            process_selector_events(selector.select(0), final=True)

        finally:
            selector.close()
            try:
                for _event in feed(""):
                    pass
            except (EOFError, ParseError):
                pass
