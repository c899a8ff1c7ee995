"""Both provider clients against a local fake provider over real HTTP, through the real SDKs."""

import gzip
import json
import logging
import socket
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from registry.choices import ModelProvider
from registry.models import ModelConfig
from runs.context import wrap_untrusted
from runs.loop import run_execute
from runs.model_clients.base import (
    AssistantTurn,
    ModelError,
    ModelRequest,
    ModelResponse,
    ToolCall,
    ToolResult,
    ToolSpec,
    Usage,
    UserMessage,
)
from runs.model_clients.factory import model_client_for
from runs.model_clients.offline import OfflinePlanner
from runs.models import Run
from tests.loopback import loopback_server
from tests.runs.conftest import apollo_draft, demo_run, read_apollo, this_week
from tests.runs.fake_provider import (
    ANTHROPIC_PATH,
    API_KEY,
    CREDENTIAL_REF,
    OPENAI_PATH,
    anthropic_message,
    openai_completion,
)

INSTRUCTIONS = "You prepare the weekly project summary. Follow the platform rules."

PROJECT_SEARCH = ToolSpec(
    name="project_search",
    description="Find the tasks, milestones and risks of a project.",
    input_schema={
        "type": "object",
        "properties": {"project_id": {"type": "string"}},
        "required": ["project_id"],
    },
)
DIRECTORY_LOOKUP = ToolSpec(
    name="directory_lookup",
    description="Find a person in the directory by role.",
    input_schema={
        "type": "object",
        "properties": {"role": {"type": "string"}},
        "required": ["role"],
    },
)
TOOLS = (PROJECT_SEARCH, DIRECTORY_LOOKUP)
CALL_1 = ToolCall(call_id="call_1", name="project_search", arguments={"project_id": "apollo"})
CALL_2 = ToolCall(call_id="call_2", name="directory_lookup", arguments={"role": "rd_lead"})
RESULT_1 = ToolResult(call_id="call_1", name="project_search", content='{"status": "ok"}')
RESULT_2 = ToolResult(
    call_id="call_2", name="directory_lookup", content='{"status": "error"}', is_error=True
)
RESULTS = (RESULT_1, RESULT_2)


@pytest.fixture
def api_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(CREDENTIAL_REF, API_KEY)
    return API_KEY


def openai_config(port: int, **parameters: Any) -> ModelConfig:
    return ModelConfig(
        name="fake-openai",
        provider=ModelProvider.OPENAI_COMPATIBLE,
        model_name="fake-gpt",
        base_url=f"http://127.0.0.1:{port}/v1",
        credential_ref=CREDENTIAL_REF,
        parameters=parameters,
    )


def anthropic_config(port: int, **parameters: Any) -> ModelConfig:
    # The Anthropic SDK appends /v1/messages itself.
    return ModelConfig(
        name="fake-anthropic",
        provider=ModelProvider.ANTHROPIC,
        model_name="fake-claude",
        base_url=f"http://127.0.0.1:{port}",
        credential_ref=CREDENTIAL_REF,
        parameters=parameters,
    )


def request_of(*transcript: Any, max_output_tokens: int = 2048) -> ModelRequest:
    return ModelRequest(
        instructions=INSTRUCTIONS,
        transcript=transcript,
        tools=TOOLS,
        max_output_tokens=max_output_tokens,
    )


def test_openai_two_turns_pair_tool_calls_and_results(model_server, api_key):
    # given
    client = model_client_for(openai_config(model_server.port, temperature=0.2, timeout_s=5))
    model_server.reply(
        openai_completion(
            content="Looking it up.",
            tool_calls=(
                ("call_1", "project_search", '{"project_id": "apollo"}'),
                ("call_2", "directory_lookup", '{"role": "rd_lead"}'),
            ),
        )
    )
    model_server.reply(openai_completion(content="Here is the summary."))
    user = UserMessage(text="Summarise project apollo for its R&D lead.")

    # when
    first = client.complete(request_of(user))
    second = client.complete(
        request_of(user, AssistantTurn(text=first.text, tool_calls=first.tool_calls), *RESULTS)
    )

    # then
    assert first == ModelResponse(
        text="Looking it up.",
        tool_calls=(CALL_1, CALL_2),
        usage=Usage(input_tokens=321, output_tokens=45),
        stop_reason="tool_calls",
        model="fake-gpt-2025-01-01",
    )
    assert second.text == "Here is the summary."
    assert second.tool_calls == ()
    assert second.stop_reason == "stop"
    assert [recorded.path for recorded in model_server.requests] == [OPENAI_PATH] * 2
    sent = model_server.requests[1]
    assert sent.headers["authorization"] == f"Bearer {API_KEY}"
    assert sent.body == {
        "model": "fake-gpt",
        "messages": [
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": "Summarise project apollo for its R&D lead."},
            {
                "role": "assistant",
                "content": "Looking it up.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "project_search",
                            "arguments": '{"project_id":"apollo"}',
                        },
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "directory_lookup", "arguments": '{"role":"rd_lead"}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"status": "ok"}'},
            {"role": "tool", "tool_call_id": "call_2", "content": '{"status": "error"}'},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.input_schema,
                },
            }
            for tool in TOOLS
        ],
        "max_tokens": 2048,
        "temperature": 0.2,
    }


def test_anthropic_two_turns_pair_tool_uses_and_results(model_server, api_key):
    # given
    client = model_client_for(anthropic_config(model_server.port, temperature=0.2, timeout_s=5))
    model_server.reply(
        anthropic_message(
            text="Looking it up.",
            tool_uses=(
                ("call_1", "project_search", {"project_id": "apollo"}),
                ("call_2", "directory_lookup", {"role": "rd_lead"}),
            ),
        )
    )
    model_server.reply(anthropic_message(text="Here is the summary."))
    user = UserMessage(text="Summarise project apollo for its R&D lead.")

    # when
    first = client.complete(request_of(user))
    second = client.complete(
        request_of(user, AssistantTurn(text=first.text, tool_calls=first.tool_calls), *RESULTS)
    )

    # then
    assert first == ModelResponse(
        text="Looking it up.",
        tool_calls=(CALL_1, CALL_2),
        usage=Usage(input_tokens=210, output_tokens=34),
        stop_reason="tool_use",
        model="fake-claude-2025-01-01",
    )
    assert second.text == "Here is the summary."
    assert second.tool_calls == ()
    assert second.stop_reason == "end_turn"
    assert [recorded.path for recorded in model_server.requests] == [ANTHROPIC_PATH] * 2
    sent = model_server.requests[1]
    # anthropic 2.x sends the API key as a bearer token, no longer as x-api-key.
    assert sent.headers["authorization"] == f"Bearer {API_KEY}"
    assert "x-api-key" not in sent.headers
    assert sent.body == {
        "model": "fake-claude",
        "system": INSTRUCTIONS,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Summarise project apollo for its R&D lead."}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Looking it up."},
                    {
                        "type": "tool_use",
                        "id": "call_1",
                        "name": "project_search",
                        "input": {"project_id": "apollo"},
                    },
                    {
                        "type": "tool_use",
                        "id": "call_2",
                        "name": "directory_lookup",
                        "input": {"role": "rd_lead"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "call_1",
                        "content": '{"status": "ok"}',
                        "is_error": False,
                    },
                    {
                        "type": "tool_result",
                        "tool_use_id": "call_2",
                        "content": '{"status": "error"}',
                        "is_error": True,
                    },
                ],
            },
        ],
        "tools": [
            {
                "name": tool.name,
                "description": tool.description,
                "input_schema": tool.input_schema,
            }
            for tool in TOOLS
        ],
        "max_tokens": 2048,
        "temperature": 0.2,
    }


def test_openai_keeps_unparsable_arguments_raw_and_sends_them_back_verbatim(model_server, api_key):
    # given
    client = model_client_for(openai_config(model_server.port))
    model_server.reply(
        openai_completion(tool_calls=(("call_1", "project_search", "{'project_id': apollo"),))
    )
    model_server.reply(openai_completion(content="Sorry."))
    user = UserMessage(text="Summarise apollo.")

    # when
    first = client.complete(request_of(user))
    client.complete(
        request_of(
            user,
            AssistantTurn(text=first.text, tool_calls=first.tool_calls),
            ToolResult(call_id="call_1", name="project_search", content="invalid arguments"),
        )
    )

    # then
    assert first.text == ""
    assert first.tool_calls == (
        ToolCall(call_id="call_1", name="project_search", arguments="{'project_id': apollo"),
    )
    assert first.usage == Usage(input_tokens=321, output_tokens=45)
    assert first.model == "fake-gpt-2025-01-01"
    assistant = model_server.requests[1].body["messages"][2]
    assert assistant == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "project_search", "arguments": "{'project_id': apollo"},
            }
        ],
    }


def test_openai_accepts_tool_calls_without_a_type_and_with_empty_arguments(model_server, api_key):
    # given a server that leaves out "type" and sends "" for a call without arguments
    client = model_client_for(openai_config(model_server.port))
    completion = openai_completion(tool_calls=(("call_1", "project_search", ""),))
    del completion["choices"][0]["message"]["tool_calls"][0]["type"]
    completion["usage"] = None
    model_server.reply(completion)

    # when
    response = client.complete(request_of(UserMessage(text="Summarise apollo.")))

    # then
    assert response.tool_calls == (ToolCall(call_id="call_1", name="project_search", arguments={}),)
    assert response.usage == Usage(input_tokens=0, output_tokens=0)


# Call 1 and its result as the Messages API is sent them.
ANTHROPIC_CALL_1 = {
    "role": "assistant",
    "content": [
        {
            "type": "tool_use",
            "id": "call_1",
            "name": "project_search",
            "input": {"project_id": "apollo"},
        }
    ],
}


def anthropic_result_1_then(text: str) -> dict:
    """The user turn that carries call 1's result, then `text`."""
    return {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "call_1",
                "content": '{"status": "ok"}',
                "is_error": False,
            },
            {"type": "text", "text": text},
        ],
    }


def test_anthropic_merges_a_user_message_after_tool_results_into_the_same_user_turn(
    model_server, api_key
):
    # given
    client = model_client_for(anthropic_config(model_server.port))
    model_server.reply(anthropic_message(text="Done."))

    # when
    client.complete(
        request_of(
            UserMessage(text="Summarise apollo."),
            AssistantTurn(text="", tool_calls=(CALL_1,)),
            RESULT_1,
            UserMessage(text="Only this week, please."),
        )
    )

    # then
    assert model_server.requests[0].body["messages"][1:] == [
        ANTHROPIC_CALL_1,
        anthropic_result_1_then("Only this week, please."),
    ]


CORRECTION = UserMessage(text="The draft does not meet the output contract: no draft.")


@pytest.mark.parametrize("text", ["", "\n\n"], ids=["empty", "whitespace"])
def test_anthropic_leaves_out_an_empty_assistant_turn_and_merges_the_user_turns_around_it(
    model_server, api_key, text
):
    # given a transcript where the model once ended a turn after a tool result with no content
    # (or only whitespace), and the host then told it what was missing
    client = model_client_for(anthropic_config(model_server.port))
    model_server.reply(anthropic_message(text="Done."))

    # when
    client.complete(
        request_of(
            UserMessage(text="Summarise apollo."),
            AssistantTurn(text="", tool_calls=(CALL_1,)),
            RESULT_1,
            AssistantTurn(text=text),
            CORRECTION,
        )
    )

    # then no message is sent without content, and user and assistant still alternate
    assert model_server.requests[0].body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Summarise apollo."}]},
        ANTHROPIC_CALL_1,
        anthropic_result_1_then(CORRECTION.text),
    ]


def test_openai_leaves_out_an_empty_assistant_turn_instead_of_sending_null_content(
    model_server, api_key
):
    # given a transcript where the model once answered with neither text nor a tool call,
    # right after a tool result and right after the user's message
    client = model_client_for(openai_config(model_server.port))
    model_server.reply(openai_completion(content="Done."))

    # when
    client.complete(
        request_of(
            UserMessage(text="Summarise apollo."),
            AssistantTurn(text=""),
            CORRECTION,
            AssistantTurn(text="", tool_calls=(CALL_1,)),
            RESULT_1,
            AssistantTurn(text=""),
            CORRECTION,
        )
    )

    # then no assistant message goes out with null content and no tool call (the API refuses
    # it), while the tool-only turn keeps its null content beside its tool calls; the user
    # turns the left-out turn separated are one message, so roles still alternate
    assert model_server.requests[0].body["messages"] == [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": f"Summarise apollo.\n\n{CORRECTION.text}"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "project_search", "arguments": '{"project_id":"apollo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"status": "ok"}'},
        {"role": "user", "content": CORRECTION.text},
    ]


def _read_then_empty_then_draft(provider: str) -> list[dict[str, Any]]:
    """A model that reads apollo, then ends a turn with no content at all, then drafts."""
    draft = json.dumps(apollo_draft())
    if provider == ModelProvider.OPENAI_COMPATIBLE:
        return [read_apollo("call_read"), openai_completion(), openai_completion(content=draft)]
    monday, sunday = this_week()
    arguments = {"project_id": "apollo", "from": monday, "to": sunday}
    return [
        anthropic_message(tool_uses=(("call_read", "project_search", arguments),)),
        anthropic_message(),
        anthropic_message(text=draft),
    ]


@pytest.mark.parametrize(
    "provider",
    [ModelProvider.OPENAI_COMPATIBLE, ModelProvider.ANTHROPIC],
    ids=["openai", "anthropic"],
)
def test_a_model_that_once_answers_empty_gets_its_correction_and_the_run_goes_on(
    demo, fake_model, provider
):
    # given a model that reads apollo, ends its next turn with no content at all (Claude does,
    # right after tool results), then drafts once told what is missing
    fake = fake_model(provider)
    for reply in _read_then_empty_then_draft(provider):
        fake.reply(reply)
    run = demo_run(demo, project_id="apollo")

    # when
    run_execute(run_id=str(run.pk))

    # then the run reaches the approval of its draft instead of failing on a refused request
    run = Run.objects.get(pk=run.pk)
    assert (run.status, run.reason_code) == ("WAITING_APPROVAL", "")
    # and the request after the empty turn carried no message without content: the empty
    # turn was left out, the correction followed the tool result
    assert len(fake.requests) == 3
    messages = fake.requests[2].body["messages"]
    assert [message["role"] for message in messages] == (
        ["system", "user", "assistant", "tool", "user"]
        if provider == ModelProvider.OPENAI_COMPATIBLE
        else ["user", "assistant", "user"]
    )
    assert all(message["content"] or message.get("tool_calls") for message in messages)


def test_openai_official_endpoint_limits_output_with_max_completion_tokens(api_key, monkeypatch):
    # given
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    config = openai_config(0)
    config.base_url = ""

    # when
    client = model_client_for(config)

    # then
    assert client.output_limit_field == "max_completion_tokens"
    with client._sdk() as sdk:
        assert str(sdk.base_url) == "https://api.openai.com/v1/"


@pytest.mark.parametrize(
    ("make_config", "error_body"),
    [
        (openai_config, lambda message: {"error": {"message": message, "type": "x"}}),
        (
            anthropic_config,
            lambda message: {"type": "error", "error": {"type": "x", "message": message}},
        ),
    ],
    ids=["openai", "anthropic"],
)
@pytest.mark.parametrize(
    ("status", "is_retryable"),
    [
        (429, True),
        (408, True),
        (500, True),
        (503, True),
        (400, False),
        (401, False),
        (409, False),
    ],
)
def test_http_errors_are_classified_and_never_carry_the_key(
    model_server, api_key, make_config, error_body, status, is_retryable
):
    # given a provider that echoes the key it received in its error message
    client = model_client_for(make_config(model_server.port))
    model_server.reply(error_body(f"rejected key {API_KEY}"), status=status)

    # when
    with pytest.raises(ModelError) as raised:
        client.complete(request_of(UserMessage(text="Hello")))

    # then
    error = raised.value
    assert error.retryable is is_retryable
    assert error.status_code == status
    assert str(error).endswith(f"answered HTTP {status}: rejected key [redacted]")
    assert API_KEY not in "".join(traceback.format_exception(error))
    assert len(model_server.requests) == 1


@pytest.mark.parametrize(
    "make_config", [openai_config, anthropic_config], ids=["openai", "anthropic"]
)
def test_a_provider_slower_than_the_timeout_is_a_retryable_error(
    model_server, api_key, make_config
):
    # given
    client = model_client_for(make_config(model_server.port, timeout_s=0.3))
    model_server.reply({}, delay_s=5)

    # when
    with pytest.raises(ModelError) as raised:
        client.complete(request_of(UserMessage(text="Hello")))

    # then
    assert raised.value.retryable is True
    assert raised.value.status_code is None
    assert str(raised.value).endswith("did not answer within 0.3 s")
    assert len(model_server.requests) == 1


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(
    "make_config", [openai_config, anthropic_config], ids=["openai", "anthropic"]
)
def test_an_unreachable_provider_is_a_retryable_error(closed_port, api_key, make_config):
    # given
    client = model_client_for(make_config(closed_port))

    # when
    with pytest.raises(ModelError) as raised:
        client.complete(request_of(UserMessage(text="Hello")))

    # then
    assert raised.value.retryable is True
    assert raised.value.status_code is None
    assert str(raised.value).endswith("could not be reached")
    assert API_KEY not in "".join(traceback.format_exception(raised.value))


@pytest.mark.parametrize(
    "make_config", [openai_config, anthropic_config], ids=["openai", "anthropic"]
)
@pytest.mark.parametrize("value", [None, ""], ids=["unset", "empty"])
def test_a_missing_credential_is_a_final_error_naming_the_variable(monkeypatch, make_config, value):
    # given
    if value is None:
        monkeypatch.delenv(CREDENTIAL_REF, raising=False)
    else:
        monkeypatch.setenv(CREDENTIAL_REF, value)

    # when
    with pytest.raises(ModelError) as raised:
        model_client_for(make_config(0))

    # then
    assert raised.value.retryable is False
    assert raised.value.status_code is None
    assert CREDENTIAL_REF in str(raised.value)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"timeout_s": "soon"}, "timeout_s must be a positive number of seconds"),
        ({"timeout_s": 0}, "timeout_s must be a positive number of seconds"),
    ],
)
def test_a_bad_timeout_is_a_final_error(api_key, parameters, message):
    with pytest.raises(ModelError, match=message) as raised:
        model_client_for(openai_config(0, **parameters))

    assert raised.value.retryable is False


@pytest.mark.parametrize(
    "make_config", [openai_config, anthropic_config], ids=["openai", "anthropic"]
)
def test_request_parameters_may_not_replace_the_fields_the_client_sets(
    model_server, api_key, make_config
):
    # given
    client = model_client_for(make_config(model_server.port))
    request = ModelRequest(
        instructions=INSTRUCTIONS,
        transcript=(UserMessage(text="Hello"),),
        parameters={"model": "another-model", "stream": True},
    )

    # when
    with pytest.raises(ModelError, match="may not set model, stream") as raised:
        client.complete(request)

    # then
    assert raised.value.retryable is False
    assert model_server.requests == []


def test_an_unknown_provider_is_a_final_error(api_key):
    config = openai_config(0)
    config.provider = "carrier-pigeon"

    with pytest.raises(ModelError, match="unknown provider 'carrier-pigeon'") as raised:
        model_client_for(config)

    assert raised.value.retryable is False


# --- a provider's server is held to what the platform sends and takes --------------------


def _answering(
    body: bytes,
    *,
    drip_s: float = 0.0,
    encoding: str | None = None,
    status: int = 200,
    content_type: str = "application/json",
):
    """A provider that answers `body` (a byte every `drip_s`, or at once)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            if encoding:
                self.send_header("Content-Encoding", encoding)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                if not drip_s:
                    self.wfile.write(body)
                    return
                for byte in body:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(drip_s)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args: Any) -> None:
            pass

    return loopback_server(Handler)


def _answer_of(make_config) -> dict:
    if make_config is openai_config:
        return openai_completion(content="hi")
    return anthropic_message(text="hi")


CONFIGS = pytest.mark.parametrize(
    "make_config", [openai_config, anthropic_config], ids=["openai", "anthropic"]
)


@CONFIGS
def test_an_answer_that_trickles_in_ends_at_the_timeout(api_key, make_config):
    with _answering(json.dumps(_answer_of(make_config)).encode(), drip_s=0.1) as port:
        client = model_client_for(make_config(port, timeout_s=1))
        started = time.monotonic()
        with pytest.raises(ModelError) as raised:
            client.complete(request_of(UserMessage(text="Hello")))

    # (at its 1 s timeout, not when the answer, many seconds long, ended)
    assert time.monotonic() - started < 6
    assert raised.value.retryable is True
    assert "did not answer within 1 s" in str(raised.value)


@CONFIGS
def test_headers_that_trickle_in_end_at_the_timeout(api_key, make_config):
    class SlowHeaders(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                for index in range(100):
                    self.wfile.write(b"X-Slow-%d: a\r\n" % index)
                    self.wfile.flush()
                    time.sleep(0.2)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args: Any) -> None:
            pass

    with loopback_server(SlowHeaders) as port:
        client = model_client_for(make_config(port, timeout_s=1))
        started = time.monotonic()
        with pytest.raises(ModelError) as raised:
            client.complete(request_of(UserMessage(text="Hello")))

    # (at its 1 s timeout, not when the answer, many seconds long, ended)
    assert time.monotonic() - started < 6
    assert "did not answer within 1 s" in str(raised.value)


@CONFIGS
def test_an_answer_larger_than_the_limit_or_compressed_is_refused(api_key, settings, make_config):
    settings.MODEL_RESPONSE_MAX_BYTES = 10_000
    large = json.dumps(_answer_of(make_config) | {"padding": "a" * 20_000}).encode()
    bomb = gzip.compress(json.dumps(_answer_of(make_config) | {"padding": "a" * 10**7}).encode())

    for body, encoding, refusal in (
        (large, None, "answered more than 10000 bytes"),
        (bomb, "gzip", "answered in gzip encoding, which was not asked for"),
    ):
        with _answering(body, encoding=encoding) as port, pytest.raises(ModelError) as raised:
            model_client_for(make_config(port)).complete(request_of(UserMessage(text="Hi")))
        assert refusal in str(raised.value)
        assert raised.value.retryable is False


@CONFIGS
def test_an_encoding_the_answer_names_is_not_quoted_unless_http_defines_it(api_key, make_config):
    # given a gateway that echoes the key it was sent as the answer's Content-Encoding
    with _answering(b"{}", encoding=f"x-{api_key}") as port, pytest.raises(ModelError) as raised:
        model_client_for(make_config(port)).complete(request_of(UserMessage(text="Hi")))

    # then the refusal says so without quoting it
    assert "answered in an encoding that was not asked for" in str(raised.value)
    assert api_key.lower() not in str(raised.value).lower()


@CONFIGS
@pytest.mark.parametrize("charset", ["rot13", "base64", "zlib", "undefined"])
def test_an_error_answer_in_a_charset_of_no_text_is_read_as_utf_8(api_key, make_config, charset):
    # given a provider's gateway overloaded, whose error page names a codec Python has but
    # that decodes no text as its charset
    with _answering(
        b"upstream overloaded",
        status=503,
        content_type=f"text/plain; charset={charset}",
    ) as port:
        client = model_client_for(make_config(port))

        # when
        with pytest.raises(ModelError) as raised:
            client.complete(request_of(UserMessage(text="Hello")))

    # then it is the provider's 503, worth another try, with its reason
    error = raised.value
    assert (error.status_code, error.retryable) == (503, True)
    assert str(error).endswith("answered HTTP 503: upstream overloaded")


@CONFIGS
def test_a_model_call_is_not_redirected_to_another_host(api_key, make_config):
    received = []

    class Elsewhere(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            self.send_response(500)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    with loopback_server(Elsewhere) as other:

        class Redirect(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(307)
                self.send_header("Location", f"http://localhost:{other}{self.path}")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        with loopback_server(Redirect) as port, pytest.raises(ModelError):
            model_client_for(make_config(port)).complete(
                request_of(UserMessage(text="Confidential transcript"))
            )

    assert received == []


@CONFIGS
def test_a_provider_gets_no_header_the_platform_s_environment_names(
    model_server, api_key, monkeypatch, make_config
):
    monkeypatch.setenv("OPENAI_ORG_ID", "org-platform")
    monkeypatch.setenv("OPENAI_PROJECT_ID", "proj-platform")
    monkeypatch.setenv("OPENAI_CUSTOM_HEADERS", "X-Gateway-Key: platform-gateway-secret")
    monkeypatch.setenv("ANTHROPIC_CUSTOM_HEADERS", "X-Gateway-Key: platform-gateway-secret")
    model_server.reply(_answer_of(make_config))

    model_client_for(make_config(model_server.port)).complete(request_of(UserMessage(text="Hi")))

    headers = model_server.requests[0].headers
    assert API_KEY in headers.get("authorization", "") + headers.get("x-api-key", "")
    assert [name for name, value in headers.items() if "platform" in value] == []


@CONFIGS
def test_a_key_a_provider_echoes_in_a_header_is_not_logged_even_at_debug(
    model_server, api_key, caplog, make_config
):
    caplog.set_level(logging.DEBUG)
    model_server.reply(
        _answer_of(make_config), headers={"X-Echo-Authorization": f"Bearer {API_KEY}"}
    )

    model_client_for(make_config(model_server.port)).complete(request_of(UserMessage(text="Hi")))

    assert caplog.records
    assert [record.name for record in caplog.records if API_KEY in record.getMessage()] == []


@CONFIGS
def test_a_provider_that_cannot_be_reached_leaves_no_watchdog_behind(api_key, make_config):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]

    def watchdogs() -> int:
        return sum(isinstance(thread, threading.Timer) for thread in threading.enumerate())

    before = watchdogs()
    with pytest.raises(ModelError):
        model_client_for(make_config(closed_port, timeout_s=60)).complete(
            request_of(UserMessage(text="Hi"))
        )

    assert watchdogs() == before


@pytest.mark.parametrize(
    "raw",
    [
        {"tasks": [{"title": "Fix login", "state": "open"}]},
        {"tasks": "3 open", "milestones": [], "risks": [], "name": "x", "from": "a", "to": "b"},
        {
            "name": "Apollo",
            "from": "2026-11-30",
            "to": "2026-12-06",
            "tasks": [{"title": "Fix login", "status": None, "date": "2026-12-01"}],
            "milestones": [],
            "risks": [],
        },
    ],
    ids=["tasks-only", "tasks-not-a-list", "item-without-status-or-source"],
)
def test_the_offline_planner_answers_from_a_tool_result_that_is_no_project_report(raw):
    """Before, the planner read any result with a `tasks` key as project_search's report, and
    a tenant's own tool answering with tasks of another shape raised KeyError or TypeError in
    the step, every time it was retried, until the run failed STEP_FAILED."""
    call = ToolCall(call_id="offline-1", name="task_search", arguments={})
    result = ToolResult(
        call_id="offline-1",
        name="task_search",
        content=wrap_untrusted(
            source="task_search@1.0.0",
            fetched_at="2026-12-04T10:00:00+00:00",
            content=json.dumps({"raw": raw}),
            allowed_use="evidence",
            references=[],
        ),
    )
    request = ModelRequest(
        instructions="",
        transcript=(
            UserMessage(text="What is open?"),
            AssistantTurn(text="", tool_calls=(call,)),
            result,
        ),
        tools=(ToolSpec(name="task_search", description="", input_schema={"type": "object"}),),
    )

    response = OfflinePlanner().complete(request)

    assert response.tool_calls == ()
    assert json.loads(response.text) == {"answer": "The tools returned nothing to report on."}


@CONFIGS
@pytest.mark.parametrize(
    ("echoed", "kept"),
    [
        ("rejected sk%2Dfake%2Dprovider%2Dsecret%2D0123456789", "rejected [redacted]"),
        (
            "upstream said: Authorization: Bearer sk-upstream-9f8e7d6c5b4a3210",
            "upstream said: Authorization: Bearer [redacted]",
        ),
    ],
    ids=["key-percent-encoded", "gateway-s-upstream-key"],
)
def test_a_provider_error_quoting_a_credential_keeps_none(
    model_server, api_key, make_config, echoed, kept
):
    """A gateway's error page may quote the key as it came in a link, or the key it sends
    upstream: the run's result and the worker's log keep the error's reason, never those."""
    model_server.reply({"error": {"message": echoed, "type": "api_error"}}, status=503)

    with pytest.raises(ModelError) as raised:
        model_client_for(make_config(model_server.port)).complete(
            request_of(UserMessage(text="Hi"))
        )

    assert str(raised.value).endswith(f"answered HTTP 503: {kept}")
