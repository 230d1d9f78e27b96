"""Test helper: a line on the terminal from a fixture's teardown (pytest would capture a print),
for tests that report what they measured or counted (tests/test_cli_bad_input.py,
tests/test_install.py)."""

from __future__ import annotations

import pytest


def say(request: pytest.FixtureRequest, text: str) -> None:
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("\n" + text)
