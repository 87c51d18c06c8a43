"""The command line's first five minutes: bad values refused in one line before anything
starts. The real CLI runs as a subprocess."""

from __future__ import annotations

import os
import subprocess  # nosec B404
import sys
from collections.abc import Mapping

import pytest

# Engines nobody listens on: enough for the router to start, or to refuse other flags.
ENGINES = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"]


def environment(extra: Mapping[str, str] = {}) -> dict[str, str]:
    """This environment without the tester's own PD_ROUTER_* settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PD_ROUTER_")}
    return {**env, **extra}


def run(*argv: str, env: Mapping[str, str] = {}) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # nosec B603
        [sys.executable, "-m", "pd_router", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env=environment(env),
    )


def refusal(done: subprocess.CompletedProcess[str]) -> str:
    """The one error line of a start refused with exit 2; before it only argparse's usage."""
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr, done.stderr
    *usage, last = done.stderr.splitlines()
    assert ": error: " in last, done.stderr
    assert all(line.startswith(("usage: ", " ")) for line in usage), done.stderr
    return last


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (
            [*ENGINES, "--port", "70000"],
            {},
            "pd-router: error: argument --port: must be a whole number from 0 to 65535 "
            "(0: any free port), got '70000'",
        ),
        (
            [*ENGINES],
            {"PD_ROUTER_PORT": "-1"},
            "pd-router: error: PD_ROUTER_PORT: must be a whole number from 0 to 65535",
        ),
        (
            [*ENGINES, "--connect-timeout", "0"],
            {},
            "pd-router: error: argument --connect-timeout: must be a number of seconds > 0",
        ),
        (
            ["demo", "--ttft", "-1"],
            {},
            "pd-router demo: error: argument --ttft: must be a number of seconds >= 0, got '-1'",
        ),
        (
            ["demo", "--itl", "-1"],
            {},
            "pd-router demo: error: argument --itl: must be a number of seconds >= 0, got '-1'",
        ),
        (
            ["demo", "--decode-nodes", "0"],
            {},
            "pd-router demo: error: argument --decode-nodes: must be a whole number >= 1, got '0'",
        ),
        (
            ["demo", "--port", "65536"],
            {},
            "pd-router demo: error: argument --port: must be a whole number from 0 to 65535",
        ),
    ],
)
def test_a_bad_value_is_one_line_and_exit_2(
    argv: list[str], env: dict[str, str], expected: str
) -> None:
    assert refusal(run(*argv, env=env)).startswith(expected)
