"""What the MCP SDK logs, withheld.

The SDK logs what a server sent: a session id, a server's answer it could not read (with the
parse error quoting it at ERROR, traceback included), a failed request's exception text. A
server may echo the credential it was sent, so none of it reaches a log. Each record from the
SDK's code keeps its logger, level and source line, and says only that its details were
withheld, with the type of its exception; what happened to a call is recorded by the platform
itself, in the call's envelope and events, without secrets.
"""

import logging
import os

import mcp

_PACKAGE = os.path.dirname(mcp.__file__) + os.sep


def _withheld(record: logging.LogRecord) -> logging.LogRecord:
    if not record.pathname.startswith(_PACKAGE):
        return record
    error = record.exc_info[1] if record.exc_info else None
    where = f"{os.path.relpath(record.pathname, _PACKAGE)}:{record.lineno}"
    record.msg = f"MCP SDK ({where}): details withheld, they may quote what a server sent" + (
        f" ({type(error).__name__})" if error is not None else ""
    )
    record.args = ()
    record.exc_info = record.exc_text = record.stack_info = None
    return record


def mcp_logs_withhold() -> None:
    """Make every log record of the SDK's code a withheld one, whichever logger it goes to
    (the SDK also logs on the root logger) and whichever handler shows it. Idempotent."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "withholds_mcp", False):
        return

    def factory(*args, **kwargs) -> logging.LogRecord:
        return _withheld(previous(*args, **kwargs))

    factory.withholds_mcp = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
