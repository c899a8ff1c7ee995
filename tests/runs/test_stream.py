"""GET /api/v1/runs/{id}/stream and the run page's /runs/{id}/stream: the run's log as
server-sent events."""

import io
import json

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import AsyncClient, RequestFactory
from django.urls import resolve

from registry.choices import Role
from registry.demo import DEMO_PASSWORD
from registry.models import ApiToken, Membership
from registry.services.common import api_tokens_revoke
from registry.services.tenancy import api_token_issue, membership_add
from runs.api import stream
from runs.loop import run_advance_step, run_execute
from runs.models import Run
from runs.services.ingress import message_ingest
from runs.services.runs import run_cancel

STREAM_HEADERS = {"HTTP_ACCEPT": "text/event-stream"}


def example_run() -> tuple[Run, str]:
    """The running example as alice, queued, with her API key."""
    call_command("seed_demo", stdout=io.StringIO())
    token, key = api_token_issue(username="alice", password=DEMO_PASSWORD)
    run = message_ingest(
        actor=token.user,
        tenant=token.tenant,
        idempotency_key="stream-1",
        channel="api",
        parts=[{"type": "text", "text": "Summarise Apollo's week for the R&D lead."}],
        metadata={"project_id": "apollo"},
    ).run
    return run, key


@pytest.fixture
def finished_run(db):
    """The running example, driven to its pause at WAITING_APPROVAL, then cancelled."""
    run, key = example_run()
    run_execute(run_id=str(run.pk))
    run_cancel(run=Run.objects.get(pk=run.pk), actor=run.actor)
    return Run.objects.get(pk=run.pk), key


def _frames(body: str) -> list[dict[str, str]]:
    frames = []
    for block in body.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        frames.append(fields)
    return frames


def test_the_stream_replays_the_log_in_order_and_ends_with_the_status(client, finished_run):
    run, key = finished_run

    response = client.get(
        f"/api/v1/runs/{run.pk}/stream", HTTP_AUTHORIZATION=f"Token {key}", **STREAM_HEADERS
    )

    assert response.status_code == 200
    assert response["Content-Type"] == "text/event-stream"
    frames = _frames(b"".join(response.streaming_content).decode())
    seqs = [int(frame["id"]) for frame in frames if "id" in frame]
    assert seqs == list(range(1, run.last_event_seq + 1))
    types = [frame["event"] for frame in frames]
    assert types[0] == "message.received"
    assert types[-2:] == ["run.finished", "end"]
    assert json.loads(frames[-1]["data"]) == {"status": "CANCELLED"}
    first = json.loads(frames[0]["data"])
    assert (first["seq"], first["type"]) == (1, "message.received")


def test_a_head_request_gets_the_streams_headers_and_no_body(finished_run):
    # (through the view itself: the test client drops a HEAD response's body on its own, and
    # a server does not, however long the body takes to make)
    run, key = finished_run
    path = f"/api/v1/runs/{run.pk}/stream"
    request = RequestFactory().head(path, HTTP_AUTHORIZATION=f"Token {key}", **STREAM_HEADERS)

    response = resolve(path).func(request, **resolve(path).kwargs)

    assert response.status_code == 200
    assert response["Content-Type"] == "text/event-stream"
    assert b"".join(response.streaming_content) == b""


def test_last_event_id_resumes_after_that_event(client, finished_run):
    run, key = finished_run

    response = client.get(
        f"/api/v1/runs/{run.pk}/stream",
        HTTP_AUTHORIZATION=f"Token {key}",
        HTTP_LAST_EVENT_ID="3",
        **STREAM_HEADERS,
    )

    frames = _frames(b"".join(response.streaming_content).decode())
    assert int(frames[0]["id"]) == 4


@pytest.mark.parametrize("last_event_id", ["1_0", "+3", "3.0", "\u0663"])
def test_a_last_event_id_not_written_in_digits_is_refused(client, finished_run, last_event_id):
    # (the stream writes each id as digits; int() would read "1_0" as 10 and skip events)
    run, key = finished_run

    response = client.get(
        f"/api/v1/runs/{run.pk}/stream",
        HTTP_AUTHORIZATION=f"Token {key}",
        HTTP_LAST_EVENT_ID=last_event_id,
        **STREAM_HEADERS,
    )

    assert response.status_code == 400
    assert response.json()["error"]["details"] == {"after": ["A valid integer is required."]}


@pytest.mark.parametrize(
    ("query", "message"),
    [
        pytest.param("after=0&after=3", "Give one value.", id="twice, not read as the last"),
        pytest.param(
            "after=", "Give a value, or leave the parameter out.", id="empty, not the start"
        ),
    ],
)
def test_an_after_given_twice_or_empty_is_refused(client, finished_run, query, message):
    run, key = finished_run

    response = client.get(
        f"/api/v1/runs/{run.pk}/stream?{query}",
        HTTP_AUTHORIZATION=f"Token {key}",
        **STREAM_HEADERS,
    )

    assert response.status_code == 400
    assert response.json()["error"]["details"] == {"after": [message]}


def test_the_after_parameter_resumes_after_that_event(client, finished_run):
    run, key = finished_run

    response = client.get(
        f"/api/v1/runs/{run.pk}/stream?after=3",
        HTTP_AUTHORIZATION=f"Token {key}",
        **STREAM_HEADERS,
    )

    frames = _frames(b"".join(response.streaming_content).decode())
    assert int(frames[0]["id"]) == 4


@pytest.mark.parametrize(
    "last_event_id",
    ["\u00b2", "\u00b9\u00b3", "9" * 5000, "-1", "1e3", "abc", ""],
    ids=[
        "superscript-two",
        "superscript-13",
        "5000-digits",
        "negative",
        "exponent",
        "letters",
        "empty",
    ],
)
def test_the_page_s_stream_serves_an_unusable_last_event_id_from_the_start(
    client, auditor, member, start_run, acme_agent, last_event_id
):
    # given a finished run of acme, and an auditor of acme signed in on the run page
    run = run_cancel(run=start_run(member), actor=member)
    client.force_login(auditor)
    client.raise_request_exception = False

    # when its stream is resumed with a Last-Event-ID that names no event: WSGI decodes
    # headers as latin-1, so the bytes 0xB2 and 0xB9 0xB3 arrive as "²" and "¹³", which
    # str.isdigit() takes and int() refuses, as it refuses more than 4300 digits
    response = client.get(f"/runs/{run.pk}/stream", HTTP_LAST_EVENT_ID=last_event_id)

    # then the log is served from its first event
    assert response.status_code == 200
    assert response["Content-Type"] == "text/event-stream"
    frames = _frames(b"".join(response.streaming_content).decode())
    seqs = [int(frame["id"]) for frame in frames if "id" in frame]
    assert seqs == list(range(1, run.last_event_seq + 1))
    assert frames[-1]["event"] == "end"


def test_the_page_s_stream_resumes_after_a_last_event_id(
    client, auditor, member, start_run, acme_agent
):
    # given a finished run of acme, and an auditor of acme signed in on the run page
    run = run_cancel(run=start_run(member), actor=member)
    client.force_login(auditor)

    # when its stream is resumed after event 2
    response = client.get(f"/runs/{run.pk}/stream", HTTP_LAST_EVENT_ID="2")

    # then the log is served from event 3
    frames = _frames(b"".join(response.streaming_content).decode())
    seqs = [int(frame["id"]) for frame in frames if "id" in frame]
    assert seqs == list(range(3, run.last_event_seq + 1))


def test_another_tenant_cannot_stream_the_run(client, finished_run):
    run, _ = finished_run
    _, key = api_token_issue(username="erin", password=DEMO_PASSWORD)

    response = client.get(
        f"/api/v1/runs/{run.pk}/stream", HTTP_AUTHORIZATION=f"Token {key}", **STREAM_HEADERS
    )

    assert response.status_code == 404
    assert response.json()["error"]["code"] == "NOT_FOUND"


@pytest.mark.parametrize(
    "asked",
    [{"data": {"format": "json"}}, {"HTTP_ACCEPT": "application/json"}],
    ids=["format parameter", "Accept header"],
)
def test_asking_the_stream_for_json_is_not_acceptable(client, finished_run, asked):
    """The stream serves events only: a client asking for JSON is told so, in the error body,
    rather than handed an event stream it did not ask for."""
    run, key = finished_run

    response = client.get(
        f"/api/v1/runs/{run.pk}/stream", HTTP_AUTHORIZATION=f"Token {key}", **asked
    )

    assert response.status_code == 406
    assert response["Content-Type"] == "application/json"
    assert response.json()["error"]["code"] == "NOT_ACCEPTABLE"


@pytest.mark.parametrize(
    "accept", ["text/event-stream;q=0", "*/*;q=0", "text/*;q=0, application/json"]
)
def test_a_client_that_accepts_no_event_stream_is_not_acceptable(client, finished_run, accept):
    """A q of 0 says "not acceptable" (RFC 9110 §12.5.1): the client is told so, in the error
    body, rather than handed the events it refused."""
    run, key = finished_run

    response = client.get(
        f"/api/v1/runs/{run.pk}/stream", HTTP_AUTHORIZATION=f"Token {key}", HTTP_ACCEPT=accept
    )

    assert response.status_code == 406
    assert response["Content-Type"] == "application/json"
    assert response.json()["error"]["code"] == "NOT_ACCEPTABLE"


@pytest.mark.parametrize("accept", ["text/event-stream, */*;q=0", "text/*, application/*;q=0"])
def test_a_client_that_accepts_the_event_stream_over_a_refused_range_gets_it(
    client, finished_run, accept
):
    run, key = finished_run

    response = client.get(
        f"/api/v1/runs/{run.pk}/stream", HTTP_AUTHORIZATION=f"Token {key}", HTTP_ACCEPT=accept
    )

    assert response.status_code == 200
    assert response["Content-Type"] == "text/event-stream"
    frames = _frames(b"".join(response.streaming_content).decode())
    assert json.loads(frames[-1]["data"]) == {"status": "CANCELLED"}


@pytest.mark.parametrize("accept", [None, "application/json"], ids=["any", "json"])
def test_options_of_the_stream_describes_it_in_json(client, finished_run, accept):
    """What OPTIONS answers is a description, not events: it is JSON, as every other
    endpoint's, labelled so."""
    run, key = finished_run
    headers = {"HTTP_ACCEPT": accept} if accept else {}

    response = client.options(
        f"/api/v1/runs/{run.pk}/stream", HTTP_AUTHORIZATION=f"Token {key}", **headers
    )

    assert response.status_code == 200
    assert response["Content-Type"] == "application/json"
    assert response.json()["renders"] == ["text/event-stream"]


def test_anonymous_cannot_stream(client, finished_run):
    run, _ = finished_run

    response = client.get(f"/api/v1/runs/{run.pk}/stream", **STREAM_HEADERS)

    assert response.status_code == 401


@pytest.mark.django_db(transaction=True)
def test_under_asgi_the_stream_is_asynchronous(finished_run):
    run, key = finished_run

    async def stream() -> tuple[int, bool, str]:
        response = await AsyncClient().get(
            f"/api/v1/runs/{run.pk}/stream",
            headers={"Authorization": f"Token {key}", "Accept": "text/event-stream"},
        )
        if not getattr(response, "streaming", False):
            return response.status_code, False, response.content.decode()
        chunks = [chunk async for chunk in response.streaming_content]
        return response.status_code, response.is_async, b"".join(chunks).decode()

    status, is_async, body = async_to_sync(stream)()

    assert (status, is_async) == (200, True)
    assert _frames(body)[-1]["event"] == "end"


@pytest.mark.django_db(transaction=True)
def test_a_run_that_ends_while_the_stream_polls_sends_its_last_events_before_the_end(
    client, monkeypatch
):
    """The step that ends the run commits between the poll's reads of the events and of the
    status: the stream must not say `end` before the events that step wrote."""
    run, key = example_run()
    assert run_advance_step(run_id=str(run.pk))
    run_cancel(run=Run.objects.get(pk=run.pk), actor=run.actor)
    seen = Run.objects.get(pk=run.pk).last_event_seq
    status_read = stream._status
    stepped = []

    def the_step_lands_now(run_id):
        if not stepped:
            stepped.append(run_advance_step(run_id=run_id))
        return status_read(run_id)

    monkeypatch.setattr(stream, "_status", the_step_lands_now)

    response = client.get(
        f"/api/v1/runs/{run.pk}/stream",
        HTTP_AUTHORIZATION=f"Token {key}",
        HTTP_LAST_EVENT_ID=str(seen),
        **STREAM_HEADERS,
    )

    frames = _frames(b"".join(response.streaming_content).decode())
    run.refresh_from_db()
    assert (run.status, run.last_event_seq) == ("CANCELLED", seen + 1)
    assert [frame.get("event") for frame in frames] == ["run.finished", "end"]


def _stream_until_access_ends(response, run: Run, end_access) -> list[dict[str, str]]:
    """Read the frames of the run's log so far, end the viewer's access, cancel the run (which
    writes one more event), and return the frames the stream sends after that."""
    chunks = iter(response.streaming_content)
    seen = [next(chunks) for _ in range(run.last_event_seq)]
    assert [int(frame["id"]) for frame in _frames(b"".join(seen).decode())] == list(
        range(1, run.last_event_seq + 1)
    )
    end_access()
    run_cancel(run=Run.objects.get(pk=run.pk), actor=run.actor)
    return _frames(b"".join(chunks).decode())


ACCESS_ENDED = [{"event": "end", "data": json.dumps({"reason": "ACCESS_ENDED"})}]


@pytest.mark.parametrize("ended_by", ["revoked token", "removed role", "changed password"])
def test_a_viewer_whose_access_ends_mid_stream_is_sent_nothing_more(
    db, client, monkeypatch, settings, ended_by
):
    # given alice following her queued run with her token
    monkeypatch.setattr(stream, "POLL_SECONDS", 0)
    settings.RUN_STREAM_MAX_SECONDS = 5
    run, key = example_run()
    response = client.get(
        f"/api/v1/runs/{run.pk}/stream", HTTP_AUTHORIZATION=f"Token {key}", **STREAM_HEADERS
    )

    def end_access() -> None:
        if ended_by == "revoked token":
            assert api_tokens_revoke(tokens=ApiToken.objects.filter(user=run.actor)) == 1
        elif ended_by == "changed password":
            run.actor.set_password("a new password, never seen")
            run.actor.save()
        else:
            Membership.objects.filter(user=run.actor, tenant=run.tenant).delete()

    # when her access ends, and then the run ends
    later = _stream_until_access_ends(response, run, end_access)

    # then the stream ends without the run's last event or its status
    assert later == ACCESS_ENDED


def test_a_stream_sent_unmasked_ends_once_its_viewer_loses_clearance(
    db, client, monkeypatch, settings
):
    # given a tenant admin of acme, also its auditor, following alice's queued run unmasked
    monkeypatch.setattr(stream, "POLL_SECONDS", 0)
    settings.RUN_STREAM_MAX_SECONDS = 5
    run, _ = example_run()
    tina = get_user_model().objects.create_user("tina", password=DEMO_PASSWORD)
    for role in (Role.ADMIN, Role.AUDITOR):
        membership_add(actor=None, user=tina, tenant=run.tenant, role=role)
    _, key = api_token_issue(username="tina", password=DEMO_PASSWORD, tenant_slug="acme")
    response = client.get(
        f"/api/v1/runs/{run.pk}/stream", HTTP_AUTHORIZATION=f"Token {key}", **STREAM_HEADERS
    )

    # when she is no longer a tenant admin, and then the run ends
    later = _stream_until_access_ends(
        response,
        run,
        lambda: Membership.objects.filter(user=tina, role=Role.ADMIN).delete(),
    )

    # then the stream ends without sending the run's last event unmasked
    assert later == ACCESS_ENDED


def test_the_page_s_stream_sends_nothing_more_once_its_session_ends(
    client, monkeypatch, settings, auditor, member, start_run, acme_agent
):
    # given an auditor of acme following a queued run on its page
    monkeypatch.setattr(stream, "POLL_SECONDS", 0)
    settings.RUN_STREAM_MAX_SECONDS = 5
    run = start_run(member)
    client.force_login(auditor)
    response = client.get(f"/runs/{run.pk}/stream")

    # when they sign out (their session is flushed), and then the run ends
    later = _stream_until_access_ends(response, run, client.logout)

    # then the stream ends without the run's last event or its status
    assert later == ACCESS_ENDED


def _quiet_stream_body(client, run: Run, key: str, *, asynchronous: bool) -> str:
    """The whole body of a stream of a run that writes nothing while it is open."""
    path = f"/api/v1/runs/{run.pk}/stream"
    if not asynchronous:
        response = client.get(path, HTTP_AUTHORIZATION=f"Token {key}", **STREAM_HEADERS)
        return b"".join(response.streaming_content).decode()

    async def body() -> str:
        response = await AsyncClient().get(
            path, headers={"Authorization": f"Token {key}", "Accept": "text/event-stream"}
        )
        return b"".join([chunk async for chunk in response.streaming_content]).decode()

    return async_to_sync(body)()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["wsgi", "asgi"])
def test_a_quiet_stream_says_it_is_alive_and_closes_at_its_deadline(
    db, client, monkeypatch, settings, asynchronous
):
    # given a queued run nobody advances, and a stream that polls every 10 ms, sends a
    # keep-alive after 0.1 s without a frame, and stays open for 1 s
    monkeypatch.setattr(stream, "POLL_SECONDS", 0.01)
    monkeypatch.setattr(stream, "KEEPALIVE_SECONDS", 0.1)
    settings.RUN_STREAM_MAX_SECONDS = 1.0
    run, key = example_run()

    body = _quiet_stream_body(client, run, key, asynchronous=asynchronous)

    # then the log so far, then keep-alive comments, and no `end`: the run goes on, and the
    # client reconnects after the last id it saw
    blocks = body.strip().split("\n\n")
    logged = [block for block in blocks if block.startswith("id: ")]
    assert len(logged) == run.last_event_seq
    rest = blocks[len(logged) :]
    assert 2 <= len(rest) <= 10
    assert set(rest) == {": keep-alive"}
