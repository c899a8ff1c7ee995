"""OPTIONS describes, for POST, the body the endpoint reads (its input serializer), not the
answer it gives: a client learns from it what to send."""

import uuid

import pytest

from approvals.api.serializers import DecisionRequestSerializer, HandoffResolveSerializer
from config.api import CommandSerializer
from evaluations.api.serializers import EvalRunStartSerializer
from registry.api.serializers import TokenRequestSerializer
from runs.api.serializers import (
    AttachmentUploadSerializer,
    MemoryCreateSerializer,
    MessageSerializer,
)

SOME_ID = uuid.UUID(int=1)


@pytest.mark.parametrize(
    ("url", "body"),
    [
        (f"/api/v1/runs/{SOME_ID}/cancel", CommandSerializer),
        ("/api/v1/memories", MemoryCreateSerializer),
        (f"/api/v1/approvals/{SOME_ID}/decision", DecisionRequestSerializer),
        (f"/api/v1/handoffs/{SOME_ID}/resolve", HandoffResolveSerializer),
        ("/api/v1/evaluations/runs", EvalRunStartSerializer),
        (f"/api/v1/evaluations/runs/{SOME_ID}/cancel", CommandSerializer),
        ("/api/v1/messages", MessageSerializer),
        ("/api/v1/attachments", AttachmentUploadSerializer),
        ("/api/v1/auth/token/", TokenRequestSerializer),
        ("/api/v1/auth/token", TokenRequestSerializer),
    ],
)
def test_options_of_a_post_describes_the_body_it_reads(api, member, url, body):
    response = api.as_user(member).options(url)

    assert response.status_code == 200
    post = response.json()["actions"]["POST"]
    assert list(post) == list(body().fields)
    assert not any(field["read_only"] for field in post.values())
