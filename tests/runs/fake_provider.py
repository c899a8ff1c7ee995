"""A local fake model provider over real HTTP, for the clients' and the loop's tests: it
answers OpenAI Chat Completions and Anthropic Messages from a queue of canned responses and
records every request it receives."""

import json
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

API_KEY = "sk-fake-provider-secret-0123456789"
CREDENTIAL_REF = "FAKE_PROVIDER_KEY"
OPENAI_PATH = "/v1/chat/completions"
ANTHROPIC_PATH = "/v1/messages"


@dataclass
class RecordedRequest:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class CannedResponse:
    status: int
    body: dict[str, Any] | bytes
    """JSON, or the bytes of a body that is not (a proxy's page, nothing)."""
    delay_s: float = 0.0
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class FakeProvider:
    """Answers from a queue of canned responses and records every request it receives."""

    port: int
    responses: deque[CannedResponse] = field(default_factory=deque)
    requests: list[RecordedRequest] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)

    def reply(
        self,
        body: dict[str, Any] | bytes,
        *,
        status: int = 200,
        delay_s: float = 0.0,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.responses.append(
            CannedResponse(
                status=status,
                body=body,
                delay_s=delay_s,
                content_type=content_type,
                headers=headers or {},
            )
        )


def handler_for(provider: FakeProvider) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            provider.requests.append(
                RecordedRequest(
                    path=self.path,
                    headers={name.lower(): value for name, value in self.headers.items()},
                    body=json.loads(self.rfile.read(length)),
                )
            )
            if self.path not in (OPENAI_PATH, ANTHROPIC_PATH):
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            canned = provider.responses.popleft()
            if canned.delay_s and provider.stopping.wait(canned.delay_s):
                return
            self._send(canned.status, canned.body, canned.content_type, canned.headers)

        def _send(
            self,
            status: int,
            body: dict[str, Any] | bytes,
            content_type: str = "application/json",
            headers: dict[str, str] | None = None,
        ) -> None:
            payload = body if isinstance(body, bytes) else json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def serving() -> Iterator[FakeProvider]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    provider = FakeProvider(port=server.server_address[1])
    server.RequestHandlerClass = handler_for(provider)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        yield provider
    finally:
        provider.stopping.set()
        server.shutdown()
        server.server_close()
        thread.join()


def openai_completion(
    *, content: str | None = None, tool_calls: tuple[tuple[str, str, str], ...] = ()
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            for call_id, name, args in tool_calls
        ]
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "fake-gpt-2025-01-01",
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if tool_calls else "stop",
            }
        ],
        "usage": {"prompt_tokens": 321, "completion_tokens": 45, "total_tokens": 366},
    }


def anthropic_message(
    *, text: str | None = None, tool_uses: tuple[tuple[str, str, dict[str, Any]], ...] = ()
) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    content += [
        {"type": "tool_use", "id": call_id, "name": name, "input": arguments}
        for call_id, name, arguments in tool_uses
    ]
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "fake-claude-2025-01-01",
        "content": content,
        "stop_reason": "tool_use" if tool_uses else "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 210, "output_tokens": 34},
    }
