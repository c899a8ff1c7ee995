"""Server-sent events of a run's log, live: every event as `id: seq`, `event: type`,
`data: json` (its seq, type, time and payload); a client reconnecting with Last-Event-ID
continues after that seq.

Under ASGI (uvicorn, production) the stream is an async iterator and holds no thread while it
waits; under WSGI (the development server) it is a plain iterator.
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, StreamingHttpResponse
from django.utils.cache import add_never_cache_headers
from rest_framework.renderers import BaseRenderer

from runs import selectors
from runs.choices import TERMINAL_STATUSES, EventType
from runs.models import Run, RunEvent
from runs.redaction import redact

POLL_SECONDS = 0.5
KEEPALIVE_SECONDS = 15.0


class EventStreamRenderer(BaseRenderer):
    """Lets `Accept: text/event-stream` negotiate; error bodies still go out as JSON."""

    media_type = "text/event-stream"
    format = "sse"

    def render(self, data, accepted_media_type=None, renderer_context=None) -> bytes:
        return json.dumps(data).encode()


@dataclass
class Poll:
    frames: list[str]
    after: int
    finished: bool


# What the viewer is shown of an event's payload.
Shape = Callable[[RunEvent], dict[str, Any]]
# Whether the viewer may still see the run, asked anew before the stream sends what it read.
Allowed = Callable[[], bool]
# What a stream ends with once its viewer may no longer see the run (a token revoked, a
# session ended, a role removed): nothing written since is sent.
ACCESS_ENDED = f"event: end\ndata: {json.dumps({'reason': 'ACCESS_ENDED'})}\n\n"


def viewer_shape(run: Run, *, cleared: bool) -> Shape:
    """Each payload as `redact` shows it to a viewer (`selectors.viewer_cleared`): without
    clearance, with the fields the run's tools hide (`selectors.hidden_fields`) and, inside
    its text, what they returned under them and what the earlier runs of its session
    returned so, and what it recalled of its requester's memory (`selectors.hidden_texts`).
    Those are read when the stream opens, for the calls `run` had ended by then and the
    recipient and memory it had; again at the first context it sends the building of (a
    run recalls its memory before its first turn, in the step that records that turn's
    context); and, where its tools hide a field, again after each call that ends later, with
    the run's state as it is then (a recipient reused from the session came with no call),
    for what the model copies afterwards."""
    contracts: dict[str, frozenset[str]] = {}
    fields = selectors.hidden_fields(run=run, cleared=cleared, contracts=contracts)

    def read(*, again: bool = False) -> frozenset[str]:
        if cleared:
            return frozenset()
        if again:
            run.refresh_from_db(fields=["state"])
        return selectors.hidden_texts(runs=[run], contracts=contracts)[run.pk]

    texts, read_after, context_seen = read(), run.last_event_seq, False

    def shape(event: RunEvent) -> dict[str, Any]:
        nonlocal texts, read_after, context_seen
        ended = event.type in (EventType.TOOL_COMPLETED, EventType.TOOL_FAILED)
        first_context = event.type == EventType.CONTEXT_BUILT and not context_seen
        context_seen = context_seen or event.type == EventType.CONTEXT_BUILT
        if (first_context or (ended and fields)) and event.seq > read_after:
            texts, read_after = read(again=True), event.seq
        return redact(event.payload, cleared=cleared, sensitive=fields, texts=texts)

    return shape


def _status(run_id: str) -> str | None:
    return Run.objects.filter(pk=run_id).values_list("status", flat=True).first()


def _poll(run_id: str, after: int, shape: Shape, allowed: Allowed) -> Poll:
    # The status is read before the events: a step commits its events with the status they
    # lead to, so the events of a run that had ended when its status was read are all found.
    status = _status(run_id)
    events = list(RunEvent.objects.filter(run_id=run_id, seq__gt=after).order_by("seq")[:200])
    ending = not events and (status in TERMINAL_STATUSES or status is None)
    if (events or ending) and not allowed():
        return Poll(frames=[ACCESS_ENDED], after=after, finished=True)
    frames = [
        f"id: {event.seq}\nevent: {event.type}\ndata: "
        + json.dumps(
            {
                "seq": event.seq,
                "type": event.type,
                "created_at": event.created_at.isoformat(),
                "payload": shape(event),
            }
        )
        + "\n\n"
        for event in events
    ]
    if events:
        return Poll(frames=frames, after=events[-1].seq, finished=False)
    if ending:
        return Poll(
            frames=[f"event: end\ndata: {json.dumps({'status': status})}\n\n"],
            after=after,
            finished=True,
        )
    return Poll(frames=[], after=after, finished=False)


class _Pacing:
    """How long a stream stays open (RUN_STREAM_MAX_SECONDS; the client then reconnects with
    Last-Event-ID), and a keep-alive comment after KEEPALIVE_SECONDS without a frame."""

    def __init__(self) -> None:
        self.deadline = time.monotonic() + settings.RUN_STREAM_MAX_SECONDS
        self.quiet_since = time.monotonic()

    def open(self) -> bool:
        return time.monotonic() < self.deadline

    def frames(self, poll: Poll) -> list[str]:
        """What to send after this poll."""
        if poll.frames:
            self.quiet_since = time.monotonic()
            return poll.frames
        if time.monotonic() - self.quiet_since > KEEPALIVE_SECONDS:
            self.quiet_since = time.monotonic()
            return [": keep-alive\n\n"]
        return []


def _sync_stream(run_id: str, after: int, shape: Shape, allowed: Allowed) -> Iterator[str]:
    pacing = _Pacing()
    while pacing.open():
        poll = _poll(run_id, after, shape, allowed)
        after = poll.after
        yield from pacing.frames(poll)
        if poll.finished:
            return
        time.sleep(POLL_SECONDS)


async def _async_stream(
    run_id: str, after: int, shape: Shape, allowed: Allowed
) -> AsyncIterator[str]:
    pacing = _Pacing()
    poll_async = sync_to_async(_poll)
    while pacing.open():
        poll = await poll_async(run_id, after, shape, allowed)
        after = poll.after
        for frame in pacing.frames(poll):
            yield frame
        if poll.finished:
            return
        await asyncio.sleep(POLL_SECONDS)


def event_stream(
    request: HttpRequest,
    run: Run,
    after: int,
    *,
    shape: Shape,
    allowed: Allowed,
) -> StreamingHttpResponse:
    """`shape` turns each stored payload into what this viewer may see; `allowed` says
    whether they still may see the run, asked before each batch of events is sent (and the
    end), so a viewer whose access ended meanwhile is sent nothing more. A HEAD request gets
    the headers only: following a live run for a body nobody reads would hold a connection
    for as long as the run."""
    run_id = str(run.pk)
    if request.method == "HEAD":
        stream = iter(())
    elif isinstance(request, ASGIRequest):
        stream = _async_stream(run_id, after, shape, allowed)
    else:
        stream = _sync_stream(run_id, after, shape, allowed)
    response = StreamingHttpResponse(stream, content_type="text/event-stream")
    # A run's log is private: no browser or proxy keeps it (as `PrivateResponsesMiddleware`).
    add_never_cache_headers(response)
    response["X-Accel-Buffering"] = "no"
    return response
