"""Ingress rate limits per actor and per tenant (Redis under `make test`), and the skill
filter of the runs list."""

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from rest_framework.throttling import SimpleRateThrottle

from registry.models import ApiToken
from runs.api.throttles import ActorIngressThrottle, TenantIngressThrottle
from runs.models import Attachment, Run
from runs.tools import limits
from tests.runs.conftest import NOTHING, message_body, row_counts


@pytest.fixture
def low_rates(monkeypatch):
    monkeypatch.setattr(
        SimpleRateThrottle,
        "THROTTLE_RATES",
        {"ingress_actor": "2/min", "ingress_tenant": "3/min", "auth_token": "100/min"},
    )
    for throttle in (ActorIngressThrottle, TenantIngressThrottle):
        monkeypatch.setattr(throttle, "THROTTLE_RATES", SimpleRateThrottle.THROTTLE_RATES)


def _post(client, key: str):
    return client.post("/api/v1/messages", message_body(), format="json", HTTP_IDEMPOTENCY_KEY=key)


def test_an_actor_over_its_rate_gets_429_with_retry_after_and_no_run(low_rates, alice):
    statuses = [_post(alice, f"key-{n}").status_code for n in range(3)]

    refused = _post(alice, "key-3")
    assert statuses[:2] == [202, 202]
    assert statuses[2] == 429
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "RATE_LIMITED"
    assert 0 < int(refused["Retry-After"]) <= 60
    assert Run.objects.count() == 2


def test_a_refusal_whose_window_lapses_before_its_wait_is_read_asks_for_at_least_a_second(
    low_rates, alice, monkeypatch
):
    # given alice at her rate (2 a minute), on a clock that stands still
    clock = [1_000_000.0]
    monkeypatch.setattr(limits, "_now", lambda: clock[0])
    assert [_post(alice, f"key-{n}").status_code for n in range(2)] == [202, 202]
    # and her minute ending just after her next request is refused, before its wait is read
    take = limits.window_take

    def refused_as_the_minute_ends(*args, **kwargs):
        taken = take(*args, **kwargs)
        clock[0] += 60
        return taken

    monkeypatch.setattr(limits, "window_take", refused_as_the_minute_ends)

    # when
    refused = _post(alice, "key-2")

    # then she is told to wait a second, not 0 (which a client takes as "at once, again")
    assert refused.status_code == 429
    assert refused["Retry-After"] == "1"
    assert refused.json()["error"]["message"].endswith("Expected available in 1 second.")


def test_with_redis_down_a_message_is_refused_503_and_leaves_nothing(alice, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"

    response = _post(alice, "key-redis-down")

    assert response.status_code == 503
    assert response.json()["error"]["code"] == "SERVICE_UNAVAILABLE"
    assert int(response["Retry-After"]) > 0
    assert row_counts() == NOTHING


def test_concurrent_requests_of_one_actor_cannot_slip_through_together(low_rates):
    """Sixteen requests of one actor at the same instant against 2 a minute: two pass (a
    cached history read and written back by each request would let most of them through)."""
    request = SimpleNamespace(auth=ApiToken(tenant_id=1, user_id=1))
    barrier = threading.Barrier(16)

    def allowed(_) -> bool:
        throttle = ActorIngressThrottle()
        barrier.wait()
        return throttle.allow_request(request, None)

    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(allowed, range(16)))

    assert answers.count(True) == 2
    refused = ActorIngressThrottle()
    assert not refused.allow_request(request, None)
    assert 59 < refused.wait() <= 60


def test_after_a_rate_is_lowered_retry_after_waits_for_the_take_that_frees_the_window(
    low_rates, monkeypatch
):
    """The wait was until the oldest take lapsed: with a window holding more takes than the
    lowered rate allows, a client that came back then was refused again."""
    # given an actor's three takes of a minute at 5 a minute, ten seconds apart
    clock = [1_000_000.0]
    monkeypatch.setattr(limits, "_now", lambda: clock[0])
    monkeypatch.setitem(SimpleRateThrottle.THROTTLE_RATES, "ingress_actor", "5/min")
    request = SimpleNamespace(auth=ApiToken(tenant_id=1, user_id=1))
    for _ in range(3):
        assert ActorIngressThrottle().allow_request(request, None)
        clock[0] += 10

    # when the rate is lowered to 2 a minute and the actor asks again
    monkeypatch.setitem(SimpleRateThrottle.THROTTLE_RATES, "ingress_actor", "2/min")
    refused = ActorIngressThrottle()
    assert not refused.allow_request(request, None)

    # then it is told to wait until the second take lapses (a minute after it), not the first
    assert refused.wait() == 40
    clock[0] += 39
    assert not ActorIngressThrottle().allow_request(request, None)
    clock[0] += 1
    assert ActorIngressThrottle().allow_request(request, None)


def test_the_tenant_rate_counts_every_actor_of_the_tenant(low_rates, alice, add_member, client_for):
    colleague = client_for(add_member("frank", "member"))

    outcomes = [
        _post(alice, "a-1").status_code,
        _post(alice, "a-2").status_code,
        _post(colleague, "f-1").status_code,
        _post(colleague, "f-2").status_code,
    ]

    assert outcomes == [202, 202, 202, 429]
    assert Run.objects.count() == 3


def test_requests_refused_by_the_actor_s_own_rate_leave_the_tenant_s_rate_alone(
    low_rates, alice, add_member, client_for
):
    # given alice at her own rate (2 a minute), hammering on with requests refused 429
    alice_statuses = [_post(alice, f"a-{n}").status_code for n in range(6)]
    assert alice_statuses == [202, 202, 429, 429, 429, 429]
    assert Run.objects.count() == 2

    # when a colleague sends the first message of their minute
    colleague = client_for(add_member("frank", "member"))
    accepted = _post(colleague, "f-1")
    refused = _post(colleague, "f-2")

    # then it is served: alice's refused requests took none of the tenant's 3 a minute,
    # and the next one, the tenant's fourth, is refused by the tenant's rate
    assert accepted.status_code == 202, accepted.content[:300]
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "RATE_LIMITED"
    assert 0 < int(refused["Retry-After"]) <= 60
    assert Run.objects.count() == 3


def test_a_request_the_tenants_rate_refuses_takes_nothing_from_the_actors_own(
    low_rates, alice, add_member, client_for, monkeypatch
):
    # given a tenant at its rate (3 a minute) after two messages of alice and one of frank
    frank = client_for(add_member("frank", "member"))
    assert [_post(alice, f"a-{n}").status_code for n in range(2)] == [202, 202]
    assert _post(frank, "f-1").status_code == 202

    # when frank, within his own rate (2 a minute), is refused by the tenant's three times,
    # and the tenant's rate is then raised
    assert [_post(frank, f"f-{n}").status_code for n in range(2, 5)] == [429, 429, 429]
    monkeypatch.setitem(SimpleRateThrottle.THROTTLE_RATES, "ingress_tenant", "100/min")

    # then frank still has the second message of his minute, and only that one
    assert _post(frank, "f-5").status_code == 202
    assert _post(frank, "f-6").status_code == 429


@pytest.mark.parametrize("url", ["/api/v1/messages", "/api/v1/attachments"])
def test_asking_what_ingress_takes_spends_none_of_the_rates(low_rates, alice, url):
    # given alice at 2 messages a minute, in a tenant at 3
    # when her client asks what an ingress endpoint takes (a CORS preflight) more often than
    # that, and sends methods it does not serve
    described = [alice.options(url).status_code for _ in range(4)]
    unserved = [alice.generic(method, url).status_code for method in ("HEAD", "GET", "PUT")]

    # then she still has her two messages, and only those
    statuses = [_post(alice, f"key-{n}").status_code for n in range(3)]
    assert described == [200] * 4
    assert unserved == [405] * 3
    assert statuses == [202, 202, 429]


def _upload(client):
    notes = SimpleUploadedFile("notes.txt", b"Apollo ships on Friday.\n", content_type="text/plain")
    return client.post("/api/v1/attachments", {"file": notes})


def test_uploads_refused_by_the_actor_s_own_rate_leave_the_tenant_s_rate_alone(
    low_rates, private_root, alice, add_member, client_for
):
    # given alice uploading past her own rate (2 a minute)
    alice_statuses = [_upload(alice).status_code for _ in range(5)]
    assert alice_statuses == [201, 201, 429, 429, 429]

    # when a colleague uploads a file
    colleague = client_for(add_member("frank", "member"))
    response = _upload(colleague)

    # then it is stored: the tenant's rate counted only alice's two stored uploads
    assert response.status_code == 201, response.content[:300]
    assert Attachment.objects.count() == 3


def test_runs_filter_by_skill_name_or_exact_version(alice):
    _post(alice, "skill-1")

    by_name = alice.get("/api/v1/runs", {"skill": "weekly-summary"}).json()
    by_version = alice.get("/api/v1/runs", {"skill": "weekly-summary@1.0.0"}).json()
    other = alice.get("/api/v1/runs", {"skill": "weekly"}).json()

    assert by_name["count"] == 1
    assert by_name["results"][0]["skill"] == "weekly-summary@1.0.0"
    assert by_version["count"] == 1
    assert other["count"] == 0
