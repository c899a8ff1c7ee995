"""A read tool for fault tests: the running example's project_search behind a gate.

While the file named by `AGENTGOV_TEST_TOOL_GATE` exists, a call waits (its run's step stays
in flight, holding the run's row lock); it then does exactly what project_search does. Every
call first appends a line to `<gate>.calls`, so a test sees that a call is in flight and how
many calls actually ran, in which worker process.
"""

import os
import signal
import time
from pathlib import Path
from typing import Any

from examples.handlers import project_search as example_project_search
from runs.tools.adapters import ToolContext, ToolOutput

GATE_ENV = "AGENTGOV_TEST_TOOL_GATE"
MAX_WAIT_SECONDS = 60


def calls_file(gate: Path) -> Path:
    return gate.with_name(gate.name + ".calls")


class GatedProjectSearch:
    def authorize(self, context: ToolContext, arguments: dict[str, Any]) -> None:
        example_project_search.authorize(context, arguments)

    def __call__(self, context: ToolContext, arguments: dict[str, Any]) -> ToolOutput:
        gate = Path(os.environ[GATE_ENV])
        with calls_file(gate).open("a") as calls:
            calls.write(f"{context.run_id} {context.call_id} {os.getpid()}\n")
        deadline = time.monotonic() + MAX_WAIT_SECONDS
        while gate.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return example_project_search(context, arguments)


project_search = GatedProjectSearch()


class KillingProjectSearch:
    """project_search that, while the gate file exists, kills the process it runs in (as the
    out-of-memory killer ends a pool process), after appending its line to `<gate>.calls`."""

    def authorize(self, context: ToolContext, arguments: dict[str, Any]) -> None:
        example_project_search.authorize(context, arguments)

    def __call__(self, context: ToolContext, arguments: dict[str, Any]) -> ToolOutput:
        gate = Path(os.environ[GATE_ENV])
        with calls_file(gate).open("a") as calls:
            calls.write(f"{context.run_id} {context.call_id} {os.getpid()}\n")
        if gate.exists():
            os.kill(os.getpid(), signal.SIGKILL)
        return example_project_search(context, arguments)


killing_project_search = KillingProjectSearch()
