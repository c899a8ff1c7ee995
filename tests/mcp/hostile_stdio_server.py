"""A raw stdio MCP server (no SDK) that lists project_status and answers tools/call as a JSON
spec file, read again on every request (HOSTILE_STDIO_SPEC), says: after `init_delay_s`
seconds for initialize, `list_delay_s` for tools/list and `call_delay_s` for tools/call, and
with a text of `size` bytes (one line, written in chunks) for tools/call. Its pid, and how
many bytes of a large answer it has written (as it writes them), are appended to
HOSTILE_STDIO_LOG."""

import json
import os
import sys
import time
from pathlib import Path

from tests.mcp.hostile_http_server import TOOL


def _spec() -> dict:
    return json.loads(Path(os.environ["HOSTILE_STDIO_SPEC"]).read_text() or "{}")


def _log(line: str) -> None:
    with open(os.environ["HOSTILE_STDIO_LOG"], "a") as log:
        log.write(line + "\n")


def _write(data: bytes) -> None:
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def _result(ident, result) -> None:
    _write(json.dumps({"jsonrpc": "2.0", "id": ident, "result": result}).encode() + b"\n")


def _large(ident, size: int) -> None:
    head, tail = json.dumps(
        {"jsonrpc": "2.0", "id": ident, "result": {"content": [{"type": "text", "text": ""}]}}
    ).split('""')
    sent, chunk = 0, b"a" * 65536
    _write((head + '"').encode())
    while sent < size:
        sent += sys.stdout.buffer.write(chunk[: size - sent])
        _log(f"sent {sent}")
    _write(('"' + tail).encode() + b"\n")


def main() -> None:
    _log(f"pid {os.getpid()}")
    for line in sys.stdin.buffer:
        message = json.loads(line)
        method, ident = message.get("method"), message.get("id")
        if ident is None:
            continue
        if method == "initialize":
            time.sleep(_spec().get("init_delay_s", 0))
            _result(
                ident,
                {
                    "protocolVersion": message["params"]["protocolVersion"],
                    "capabilities": {"tools": {}},
                    "serverInfo": {"name": "hostile-stdio", "version": "1"},
                },
            )
        elif method == "tools/list":
            time.sleep(_spec().get("list_delay_s", 0))
            _result(ident, {"tools": [TOOL]})
        elif method == "tools/call":
            time.sleep(_spec().get("call_delay_s", 0))
            if size := _spec().get("size"):
                _large(ident, size)
            else:
                _result(ident, {"content": [{"type": "text", "text": "ok"}], "isError": False})
        else:
            error = {"code": -32601, "message": "no such method"}
            _write(json.dumps({"jsonrpc": "2.0", "id": ident, "error": error}).encode() + b"\n")


if __name__ == "__main__":
    main()
