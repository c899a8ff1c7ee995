"""A raw streamable-HTTP MCP endpoint (no SDK) whose answers to tools/call (or to the spec's
`method`, initialize included) follow a JSON spec file read again on every request
(HOSTILE_HTTP_SPEC): HTTP status, content type, body (where {auth} becomes the Authorization
header it was sent and {id} the request's id), delay, an SSE answer that never ends, or a text
of `size` bytes (compressed, with `gzip`). Every tools/call is appended to HOSTILE_HTTP_LOG."""

import gzip
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# The project_status definition the hostile servers of both transports serve in the tests.
TOOL = {
    "name": "project_status",
    "description": "This week's status of one project.",
    "inputSchema": {
        "type": "object",
        "properties": {"project_id": {"type": "string"}},
        "required": ["project_id"],
    },
    "annotations": {"readOnlyHint": True},
}
SESSION_ID = "s1"


def _call_spec() -> dict:
    return json.loads(Path(os.environ["HOSTILE_HTTP_SPEC"]).read_text() or "{}")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Mcp-Session-Id", SESSION_ID)
        self.end_headers()
        self.wfile.write(body)

    def _result(self, ident, result) -> None:
        self._send(200, json.dumps({"jsonrpc": "2.0", "id": ident, "result": result}).encode())

    def do_GET(self):
        self._send(405, b"")

    def do_DELETE(self):
        self._send(200, b"")

    def do_POST(self):
        message = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        method, ident = message.get("method"), message.get("id")
        if ident is None:
            self._send(202, b"")
        elif method == _call_spec().get("method", "tools/call"):
            self._call(ident)
        elif method == "initialize":
            self._result(
                ident,
                {
                    "protocolVersion": message["params"]["protocolVersion"],
                    "capabilities": {"tools": {}},
                    "serverInfo": {"name": "hostile-http", "version": "1"},
                },
            )
        elif method == "tools/list":
            self._result(ident, {"tools": [TOOL]})
        else:
            error = {"code": -32601, "message": "no such method"}
            self._send(200, json.dumps({"jsonrpc": "2.0", "id": ident, "error": error}).encode())

    def _call(self, ident) -> None:
        with open(os.environ["HOSTILE_HTTP_LOG"], "a") as log:
            log.write("call\n")
        call = _call_spec()
        time.sleep(call.get("delay_s", 0))
        if call.get("body") is not None:
            body = call["body"].replace("{auth}", self.headers.get("Authorization", ""))
            body = body.replace("{id}", json.dumps(ident))
            self._send(
                call.get("status", 200),
                body.encode(),
                call.get("content_type", "application/json"),
            )
        elif call.get("size"):
            if call.get("gzip"):
                self._gzipped(ident, call["size"])
            else:
                self._large(ident, call["size"], sse=call.get("sse", False))
        elif call.get("sse_forever"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Mcp-Session-Id", SESSION_ID)
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b": keep-alive\n\n")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                return
        else:
            self._result(ident, {"content": [{"type": "text", "text": "ok"}], "isError": False})

    def _large(self, ident, size: int, *, sse: bool) -> None:
        """An answer whose text is `size` bytes, written in chunks; how many bytes were
        written before the client stopped reading is appended to the log."""
        head, tail = json.dumps(
            {"jsonrpc": "2.0", "id": ident, "result": {"content": [{"type": "text", "text": ""}]}}
        ).split('""')
        head, tail = (head + '"').encode(), ('"' + tail).encode()
        if sse:
            head, tail = b"event: message\ndata: " + head, tail + b"\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream" if sse else "application/json")
        self.send_header("Content-Length", str(len(head) + size + len(tail)))
        self.send_header("Mcp-Session-Id", SESSION_ID)
        self.end_headers()
        sent, chunk = 0, b"a" * 65536
        try:
            self.wfile.write(head)
            while sent < size:
                sent += self.wfile.write(chunk[: size - sent])
            self.wfile.write(tail)
        except OSError:
            pass
        finally:
            with open(os.environ["HOSTILE_HTTP_LOG"], "a") as log:
                log.write(f"sent {sent}\n")

    def _gzipped(self, ident, size: int) -> None:
        """An answer whose text is `size` bytes, sent compressed (unasked)."""
        text = "a" * size
        body = json.dumps(
            {"jsonrpc": "2.0", "id": ident, "result": {"content": [{"type": "text", "text": text}]}}
        )
        compressed = gzip.compress(body.encode())
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(compressed)))
        self.send_header("Mcp-Session-Id", SESSION_ID)
        self.end_headers()
        self.wfile.write(compressed)


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
