"""The runs API: who sees which run, filters, pagination, the event log and cancel."""

from datetime import UTC, datetime, timedelta

import pytest
from django.db import transaction
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from registry.choices import Role
from runs.choices import RunStatus
from runs.models import Run, RunEvent, Source
from runs.services.runs import run_cancel, run_transition
from tests.approvals.test_sensitive_fields import api_as
from tests.runs.conftest import RUNS, demo_run, event_log

# Queries of one list request, whatever the number of runs (measured: 8): the token, the
# tenant-member check, the view-all check, the count, the page with its actors, the
# viewer's clearance to see results unmasked (read once per tenant), the result
# contracts of the runs' tools, for the fields they hide (each version read once), and the
# calls of the earlier runs of their sessions whose tools hide fields.
RUNS_LIST_QUERIES = 8


def _error(response) -> dict:
    return response.json()["error"]


def _ids(response) -> list[str]:
    return [run["id"] for run in response.json()["results"]]


def _state(run: Run) -> tuple:
    """Everything cancel may change, to prove a refusal changed nothing."""
    run = Run.objects.get(pk=run.pk)
    return (
        run.status,
        run.reason_code,
        run.cancel_requested_at,
        run.finished_at,
        run.last_event_seq,
        RunEvent.objects.filter(run=run).count(),
    )


def _set_status(run: Run, status: RunStatus, reason_code: str = "") -> Run:
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        return run_transition(run=locked, status=status, reason_code=reason_code)


@pytest.fixture
def bob(add_member):
    """Another member of acme."""
    return add_member("bob", Role.MEMBER)


@pytest.fixture
def tenant_admin(add_member):
    return add_member("ada", Role.ADMIN)


# --- visibility ----------------------------------------------------------------------------


def test_a_member_lists_only_their_own_runs(alice, client_for, acme, member, bob, start_run):
    first = start_run(member)
    second = start_run(member)
    bobs = start_run(bob)

    mine = alice.get(RUNS)
    his = client_for(bob, acme).get(RUNS)

    assert mine.status_code == 200
    assert mine.json()["count"] == 2
    assert _ids(mine) == [str(second.pk), str(first.pk)]
    assert his.status_code == 200
    assert _ids(his) == [str(bobs.pk)]


def test_an_auditor_lists_every_run_of_the_tenant_and_no_other(
    client_for, acme, member, bob, auditor, globex, globex_member, start_run, acme_agent
):
    runs = [start_run(member), start_run(bob), start_run(member)]
    start_run(globex_member, globex)

    response = client_for(auditor, acme).get(RUNS)

    assert response.status_code == 200
    assert response.json()["count"] == 3
    assert _ids(response) == [str(run.pk) for run in reversed(runs)]


def test_a_tenant_admin_lists_every_run_of_the_tenant(
    client_for, acme, member, bob, tenant_admin, start_run, acme_agent
):
    runs = {str(start_run(member).pk), str(start_run(bob).pk)}

    response = client_for(tenant_admin, acme).get(RUNS)

    assert set(_ids(response)) == runs


def test_a_run_is_shown_with_its_fields(alice, member, start_run):
    run = start_run(member)

    response = alice.get(f"{RUNS}/{run.pk}")

    assert response.status_code == 200
    body = response.json()
    assert body["id"] == str(run.pk)
    assert body["status"] == "QUEUED"
    assert body["reason_code"] == ""
    assert body["session_id"] == str(run.session_id)
    assert body["actor"] == "alice"
    assert body["channel"] == "api"
    assert body["capability_hash"] == run.capability_hash
    assert body["trace_id"] == run.trace_id
    assert body["cancel_requested_at"] is None
    assert body["finished_at"] is None
    assert body["links"]["self"] == f"/api/v1/runs/{run.pk}"
    assert body["links"]["events"] == f"/api/v1/runs/{run.pk}/events"


def test_an_auditor_sees_a_member_s_run_and_its_events(
    client_for, acme, auditor, member, start_run, acme_agent
):
    run = start_run(member)
    client = client_for(auditor, acme)

    detail = client.get(f"{RUNS}/{run.pk}")
    events = client.get(f"{RUNS}/{run.pk}/events")

    assert detail.status_code == 200
    assert detail.json()["id"] == str(run.pk)
    assert events.status_code == 200
    assert [event["seq"] for event in events.json()["results"]] == [1, 2, 3, 4]


def test_another_member_s_run_is_not_found(client_for, acme, member, bob, start_run, acme_agent):
    run = start_run(member)
    before = _state(run)
    client = client_for(bob, acme)

    responses = [
        client.get(f"{RUNS}/{run.pk}"),
        client.get(f"{RUNS}/{run.pk}/events"),
        client.post(f"{RUNS}/{run.pk}/cancel"),
    ]

    assert [response.status_code for response in responses] == [404, 404, 404]
    assert {_error(response)["code"] for response in responses} == {"NOT_FOUND"}
    assert _state(run) == before


def test_another_tenant_s_token_sees_nothing(
    client_for, member, globex, globex_member, start_run, acme_agent
):
    run = start_run(member)
    before = _state(run)
    client = client_for(globex_member, globex)

    listed = client.get(RUNS)
    responses = [
        client.get(f"{RUNS}/{run.pk}"),
        client.get(f"{RUNS}/{run.pk}/events"),
        client.post(f"{RUNS}/{run.pk}/cancel"),
    ]

    assert listed.status_code == 200
    assert listed.json()["count"] == 0
    assert listed.json()["results"] == []
    assert [response.status_code for response in responses] == [404, 404, 404]
    assert {(_error(response)["code"], _error(response)["message"]) for response in responses} == {
        ("NOT_FOUND", "No such run.")
    }
    assert _state(run) == before


def test_one_s_own_run_is_not_found_through_a_token_of_another_tenant(
    client_for, add_member, acme, globex, start_run, acme_agent
):
    # given frank, a member of acme and globex, with a run in acme
    frank = add_member("frank", Role.MEMBER)
    add_member("frank", Role.MEMBER, tenant=globex)
    run = start_run(frank, acme)
    client = client_for(frank, globex)

    # then his globex token neither lists nor shows it
    assert client.get(RUNS).json()["count"] == 0
    assert client.get(f"{RUNS}/{run.pk}").status_code == 404
    assert client.post(f"{RUNS}/{run.pk}/cancel").status_code == 404
    # nor tells a body it would refuse from a run it does not show
    assert client.post(f"{RUNS}/{run.pk}/cancel", {"bogus": 1}, format="json").status_code == 404
    assert Run.objects.get(pk=run.pk).status == "QUEUED"


@pytest.mark.parametrize("run_id", ["not-a-uuid", "1", "0b67ad91-a2a6-4d90-8358-a278e96dd7a9"])
@pytest.mark.parametrize(
    ("method", "suffix"), [("get", ""), ("get", "/events"), ("post", "/cancel")]
)
def test_an_unknown_or_malformed_run_id_is_not_found(alice, run_id, method, suffix):
    response = getattr(alice, method)(f"{RUNS}/{run_id}{suffix}")

    assert response.status_code == 404
    assert (_error(response)["code"], _error(response)["message"]) == ("NOT_FOUND", "No such run.")


def odd_spellings(run_id) -> list[str]:
    """Spellings of a UUID that `uuid.UUID` reads, other than the one the API writes."""
    return [
        str(run_id).upper(),
        f"{{{run_id}}}",
        f"urn:uuid:{run_id}",
        run_id.hex,
    ]


@pytest.mark.parametrize(
    ("method", "suffix"),
    [("get", ""), ("get", "/events"), ("get", "/stream"), ("post", "/cancel")],
)
def test_a_run_answers_at_its_id_as_written_and_at_no_other_spelling_of_it(
    alice, member, start_run, acme_agent, method, suffix
):
    # given a run, whose id the API writes lowercase and hyphenated
    run = start_run(member)
    before = _state(run)

    # when its id is spelled uppercase, in braces, as a URN or without hyphens
    responses = [
        getattr(alice, method)(f"{RUNS}/{spelling}{suffix}") for spelling in odd_spellings(run.pk)
    ]

    # then each is not found, as a page's URL is, and nothing changed
    assert [response.status_code for response in responses] == [404] * 4
    assert {response.json()["error"]["code"] for response in responses} == {"NOT_FOUND"}
    assert _state(run) == before
    # while the id as written answers
    if method == "get":
        assert alice.get(f"{RUNS}/{run.pk}{suffix}", HTTP_ACCEPT="*/*").status_code == 200


@pytest.mark.parametrize("suffix", ["", "/events", "/stream"])
def test_a_format_the_api_does_not_serve_is_not_acceptable_for_a_run_that_exists(
    alice, member, start_run, acme_agent, suffix
):
    run = run_cancel(run=start_run(member), actor=member)

    by_parameter = alice.get(f"{RUNS}/{run.pk}{suffix}", {"format": "xml"})
    by_header = alice.get(f"{RUNS}/{run.pk}{suffix}", HTTP_ACCEPT="application/xml")

    assert (by_parameter.status_code, by_header.status_code) == (406, 406)
    assert _error(by_parameter)["code"] == _error(by_header)["code"] == "NOT_ACCEPTABLE"


@pytest.mark.parametrize(
    ("suffix", "served"), [("", "json"), ("/events", "json"), ("/stream", "sse")]
)
def test_a_format_not_served_is_refused_naming_what_is_served_without_echoing_it(
    alice, member, start_run, suffix, served
):
    run = start_run(member)

    response = alice.get(f"{RUNS}/{run.pk}{suffix}", {"format": "x" * 10_000})

    assert response.status_code == 406
    assert _error(response) == {
        "code": "NOT_ACCEPTABLE",
        "message": f"Only {served} is served here.",
        "details": {},
    }


@pytest.mark.parametrize(
    ("method", "suffix"),
    [("get", ""), ("get", "/{id}"), ("get", "/{id}/events"), ("post", "/{id}/cancel")],
)
def test_anonymous_requests_are_refused(member, start_run, acme_agent, method, suffix):
    run = start_run(member)

    response = getattr(APIClient(), method)(RUNS + suffix.format(id=run.pk))

    assert response.status_code == 401
    assert _error(response)["code"] == "AUTHENTICATION_REQUIRED"
    assert Run.objects.get(pk=run.pk).status == "QUEUED"


# --- filters and pagination ----------------------------------------------------------------


def test_runs_filter_by_status_repeatable(alice, member, start_run):
    queued = start_run(member)
    cancelled = run_cancel(run=start_run(member), actor=member)
    refused = _set_status(start_run(member), RunStatus.REFUSED, "TEST")

    only_queued = alice.get(RUNS, {"status": "QUEUED"})
    two = alice.get(RUNS, {"status": ["CANCELLED", "REFUSED"]})
    none = alice.get(RUNS, {"status": "COMPLETED"})

    assert _ids(only_queued) == [str(queued.pk)]
    assert set(_ids(two)) == {str(cancelled.pk), str(refused.pk)}
    assert two.json()["count"] == 2
    assert none.json()["count"] == 0


def test_an_unknown_status_filter_is_refused(alice):
    response = alice.get(RUNS, {"status": "DONE"})

    assert response.status_code == 400
    assert _error(response)["code"] == "VALIDATION_ERROR"
    assert set(_error(response)["details"]) == {"status"}


def test_an_unknown_status_is_refused_naming_the_statuses_without_echoing_the_value(alice):
    response = alice.get(RUNS, {"status": "D" * 10_000})

    assert response.status_code == 400
    statuses = ", ".join(RunStatus.values)
    assert _error(response)["details"] == {"status": [f"Not one of the choices: {statuses}."]}


def test_a_parameter_the_list_does_not_take_is_refused_rather_than_ignored(
    alice, member, start_run
):
    # given a queued run, which a misspelt status filter would otherwise list
    start_run(member)

    response = alice.get(RUNS, {"stauts": "COMPLETED", "x" * 10_000: "1"})

    assert response.status_code == 400
    assert _error(response) == {
        "code": "VALIDATION_ERROR",
        "message": "Unknown parameters. This list takes: status, session, skill, "
        "created_after, created_before, page, page_size, format.",
        "details": {"stauts": ["Unknown parameter."], "x" * 64 + "…": ["Unknown parameter."]},
    }


def test_the_list_takes_its_filters_its_pages_and_a_format_together(alice, member, start_run):
    run = start_run(member)

    response = alice.get(
        RUNS,
        {"status": run.status, "skill": run.skill, "page": 1, "page_size": 5, "format": "json"},
    )

    assert response.status_code == 200
    assert _ids(response) == [str(run.pk)]


def test_a_list_request_with_too_many_parameters_is_refused_saying_so(alice, settings):
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 100
    query = "&".join(f"status=DONE{index}" for index in range(101))

    response = alice.get(f"{RUNS}?{query}")

    assert response.status_code == 400
    assert _error(response) == {
        "code": "VALIDATION_ERROR",
        "message": "The request carried more than 100 parameters.",
        "details": {"max_parameters": 100},
    }


def test_runs_filter_by_session(alice, member, start_run):
    first = start_run(member)
    same_session = start_run(member, session_id=first.session_id)
    start_run(member)

    response = alice.get(RUNS, {"session": str(first.session_id)})

    assert response.json()["count"] == 2
    assert set(_ids(response)) == {str(first.pk), str(same_session.pk)}


def test_a_malformed_session_filter_is_refused(alice):
    response = alice.get(RUNS, {"session": "not-a-uuid"})

    assert response.status_code == 400
    assert _error(response)["code"] == "VALIDATION_ERROR"


def test_runs_filter_by_creation_range(alice, member, start_run):
    # given three runs created on the 5th, 6th and 7th at noon
    day = datetime(2025, 1, 5, 12, tzinfo=UTC)
    runs = []
    for offset in range(3):
        run = start_run(member)
        Run.objects.filter(pk=run.pk).update(created_at=day + timedelta(days=offset))
        runs.append(str(run.pk))
    sixth = (day + timedelta(days=1)).isoformat()

    after = alice.get(RUNS, {"created_after": sixth})
    before = alice.get(RUNS, {"created_before": sixth})
    window = alice.get(
        RUNS,
        {
            "created_after": (day + timedelta(hours=1)).isoformat(),
            "created_before": (day + timedelta(days=2)).isoformat(),
        },
    )

    # created_after is inclusive, created_before exclusive
    assert _ids(after) == [runs[2], runs[1]]
    assert _ids(before) == [runs[0]]
    assert _ids(window) == [runs[1]]


def test_a_creation_range_that_ends_before_it_starts_is_refused(alice, member, start_run):
    # given a run created on the 6th at noon
    run = start_run(member)
    Run.objects.filter(pk=run.pk).update(created_at=datetime(2025, 1, 6, 12, tzinfo=UTC))

    # when the bounds are given the wrong way round
    response = alice.get(
        RUNS,
        {"created_after": "2025-01-07T00:00:00Z", "created_before": "2025-01-05T00:00:00Z"},
    )

    # then the client is told so, rather than answered that no run was made
    assert response.status_code == 400
    message = ["created_after must not be after created_before."]
    assert _error(response)["code"] == "VALIDATION_ERROR"
    assert _error(response)["details"] == {"created_after": message, "created_before": message}


@pytest.mark.parametrize(
    ("created_after", "created_before", "found"),
    [
        ("2025-01-06T12:00:00Z", "2025-01-06T12:00:00Z", False),
        # 13:00 at +02:00 is 11:00 UTC, before 12:00 UTC however the bounds read as text
        ("2025-01-06T13:00:00+02:00", "2025-01-06T12:00:00Z", True),
    ],
    ids=["equal", "offsets"],
)
def test_a_creation_range_compares_its_bounds_as_instants(
    alice, member, start_run, created_after, created_before, found
):
    run = start_run(member)
    Run.objects.filter(pk=run.pk).update(created_at=datetime(2025, 1, 6, 11, 30, tzinfo=UTC))

    response = alice.get(RUNS, {"created_after": created_after, "created_before": created_before})

    assert response.status_code == 200
    assert _ids(response) == ([str(run.pk)] if found else [])


def test_an_offset_postgresql_cannot_hold_is_read_as_the_same_instant(alice, member, start_run):
    # given a run created at 12:00 UTC on the 5th
    run = start_run(member)
    Run.objects.filter(pk=run.pk).update(created_at=datetime(2025, 1, 5, 12, tzinfo=UTC))

    # 11:59 on the 6th at +23:59 is 12:00 on the 5th in UTC
    response = alice.get(RUNS, {"created_after": "2025-01-06T11:59:00+23:59"})

    assert response.status_code == 200
    assert _ids(response) == [str(run.pk)]


def test_an_instant_before_the_first_year_is_refused(alice):
    response = alice.get(RUNS, {"created_after": "0001-01-01T01:00:00+23:00"})

    assert response.status_code == 400
    assert _error(response)["details"] == {"created_after": ["Outside the range of dates."]}


@pytest.mark.parametrize("parameter", ["status", "created_after", "session"])
def test_a_filter_given_empty_is_refused(alice, parameter):
    response = alice.get(f"{RUNS}?{parameter}=")

    assert response.status_code == 400
    assert list(_error(response)["details"]) == [parameter]


@pytest.mark.parametrize("value", [" ", "%20%09", "%C2%A0"], ids=["space", "tab", "nbsp"])
def test_a_session_filter_of_blanks_alone_is_refused_rather_than_left_out(
    alice, member, start_run, value
):
    # given a run of alice's
    start_run(member)

    # when the session filter holds only blanks, which the id's field strips to nothing
    response = alice.get(f"{RUNS}?session={value}")

    # then it is refused as an empty filter is, rather than answering with every run
    assert response.status_code == 400
    assert _error(response)["details"] == {"session": ["Give a value, or leave the parameter out."]}


@pytest.mark.parametrize(
    "query",
    [
        "created_after=2025-01-01T00:00:00Z&created_after=2030-01-01T00:00:00Z",
        "session=01a23e5b-b554-7489-866b-a4759b5f4a7d&session=01a23e5b-b554-7489-866b-a4759b5f4a7e",
        "skill=weekly-summary&skill=other",
    ],
    ids=["instant", "session", "skill"],
)
def test_a_filter_of_one_value_given_twice_is_refused(alice, member, start_run, query):
    start_run(member)

    response = alice.get(f"{RUNS}?{query}")

    assert response.status_code == 400
    assert _error(response)["details"] == {query.partition("=")[0]: ["Give one value."]}


@pytest.mark.parametrize("value", ["weekly-summary@", "@", "@1.0.0", "a@b@c", "weekly summary"])
def test_a_skill_filter_that_names_no_skill_is_refused(alice, member, start_run, value):
    # given a run, and a skill filter that is neither a name nor name@version
    start_run(member)

    # when the runs are listed by it
    response = alice.get(RUNS, {"skill": value})

    # then it is refused saying what a skill filter is, rather than answering no run
    assert response.status_code == 400
    assert _error(response)["details"] == {"skill": ["Give a skill as name or name@version."]}


def test_a_filter_of_several_choices_takes_each_value_given(alice, member, start_run):
    run = start_run(member)

    response = alice.get(f"{RUNS}?status=COMPLETED&status={run.status}")

    assert response.status_code == 200
    assert _ids(response) == [str(run.pk)]


def test_a_malformed_date_filter_is_refused(alice):
    response = alice.get(RUNS, {"created_after": "last tuesday"})

    assert response.status_code == 400
    assert _error(response)["code"] == "VALIDATION_ERROR"


def test_runs_are_paginated_newest_first(alice, member, start_run):
    runs = [str(start_run(member).pk) for _ in range(3)]

    first_page = alice.get(RUNS, {"page_size": 2})
    second_page = alice.get(RUNS, {"page_size": 2, "page": 2})

    assert first_page.json()["count"] == 3
    assert _ids(first_page) == [runs[2], runs[1]]
    assert first_page.json()["next"] is not None
    assert first_page.json()["previous"] is None
    assert _ids(second_page) == [runs[0]]
    assert second_page.json()["next"] is None


@pytest.mark.parametrize("run_count", [1, 6])
def test_the_run_list_costs_the_same_queries_for_any_number_of_runs(
    client_for,
    acme,
    auditor,
    member,
    bob,
    start_run,
    acme_agent,
    run_count,
    django_assert_max_num_queries,
):
    for index in range(run_count):
        start_run(member if index % 2 else bob)
    client = client_for(auditor, acme)

    with django_assert_max_num_queries(RUNS_LIST_QUERIES):
        response = client.get(RUNS)

    assert response.json()["count"] == run_count


# --- events --------------------------------------------------------------------------------


def test_events_are_listed_in_seq_order(alice, member, start_run):
    run = start_run(member)

    response = alice.get(f"{RUNS}/{run.pk}/events")

    assert response.status_code == 200
    results = response.json()["results"]
    assert [(event["seq"], event["type"]) for event in results] == event_log(run)
    assert [event["type"] for event in results] == [
        "message.received",
        "message.normalized",
        "session.loaded",
        "capability.resolved",
    ]
    stored = {str(event.pk): event.payload for event in RunEvent.objects.filter(run=run)}
    assert {event["id"]: event["payload"] for event in results} == stored
    assert set(results[0]) == {"id", "seq", "type", "payload", "created_at"}


def test_events_after_a_seq_return_only_the_later_ones(alice, member, start_run):
    run = start_run(member)

    after_two = alice.get(f"{RUNS}/{run.pk}/events", {"after": 2})
    after_last = alice.get(f"{RUNS}/{run.pk}/events", {"after": 4})
    after_zero = alice.get(f"{RUNS}/{run.pk}/events", {"after": 0})

    assert [event["seq"] for event in after_two.json()["results"]] == [3, 4]
    assert after_last.json()["results"] == []
    assert [event["seq"] for event in after_zero.json()["results"]] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "after",
    [
        "-1",
        "two",
        "1.5",
        # Python's int() reads each of these as a number: 1_0 as 10, the others as 2
        "1_0",
        "+2",
        " 2",
        "2.0",
        "\u0662",  # ARABIC-INDIC DIGIT TWO
        "\uff12",  # FULLWIDTH DIGIT TWO
    ],
)
def test_an_invalid_after_is_refused(alice, member, start_run, after):
    run = start_run(member)

    response = alice.get(f"{RUNS}/{run.pk}/events", {"after": after})

    assert response.status_code == 400
    assert _error(response)["code"] == "VALIDATION_ERROR"
    assert set(_error(response)["details"]) == {"after"}


def test_an_after_given_twice_is_refused_rather_than_read_as_the_last(alice, member, start_run):
    run = start_run(member)

    response = alice.get(f"{RUNS}/{run.pk}/events?after=0&after=2")

    assert response.status_code == 400
    assert _error(response)["details"] == {"after": ["Give one value."]}


def test_an_after_given_empty_is_refused_rather_than_read_as_the_start(alice, member, start_run):
    run = start_run(member)

    response = alice.get(f"{RUNS}/{run.pk}/events?after=")

    assert response.status_code == 400
    assert _error(response)["details"] == {"after": ["Give a value, or leave the parameter out."]}


# --- cancel --------------------------------------------------------------------------------


def test_the_requester_cancels_a_queued_run(alice, member, start_run):
    run = start_run(member)

    response = alice.post(f"{RUNS}/{run.pk}/cancel")

    assert response.status_code == 200
    body = response.json()
    assert (body["id"], body["status"], body["reason_code"]) == (
        str(run.pk),
        "CANCELLED",
        "CANCELLED_BY_USER",
    )
    assert body["cancel_requested_at"] is not None
    assert body["finished_at"] is not None
    run.refresh_from_db()
    assert (run.status, run.reason_code) == ("CANCELLED", "CANCELLED_BY_USER")
    assert run.cancel_requested_at is not None
    assert run.finished_at is not None
    assert event_log(run)[-1] == (5, "run.finished")
    assert run.last_event_seq == 5
    assert run.events.get(seq=5).payload == {
        "status": "CANCELLED",
        "reason_code": "CANCELLED_BY_USER",
        "cancelled_by": "alice",
    }


@pytest.mark.parametrize(
    ("body", "details"),
    [
        ("{{{", None),
        ('{"reason": "late"}', {"reason": ["Unknown field."]}),
        ("[]", None),
    ],
    ids=["malformed", "unknown-field", "not-an-object"],
)
def test_a_cancel_with_a_body_it_does_not_read_is_refused(alice, member, start_run, body, details):
    run = start_run(member)
    before = _state(run)

    response = alice.post(f"{RUNS}/{run.pk}/cancel", body, content_type="application/json")

    assert response.status_code == 400
    assert _error(response)["code"] == "VALIDATION_ERROR"
    if details is not None:
        assert _error(response)["details"] == details
    assert _state(run) == before


def test_a_cancel_with_an_empty_object_cancels(alice, member, start_run):
    run = start_run(member)

    response = alice.post(f"{RUNS}/{run.pk}/cancel", {}, format="json")

    assert response.status_code == 200
    assert response.json()["status"] == "CANCELLED"


def test_cancelling_again_changes_nothing(alice, member, start_run):
    run = start_run(member)
    first = alice.post(f"{RUNS}/{run.pk}/cancel")
    before = _state(run)

    again = alice.post(f"{RUNS}/{run.pk}/cancel")

    assert (first.status_code, again.status_code) == (200, 200)
    assert again.json()["status"] == "CANCELLED"
    assert again.json()["cancel_requested_at"] == first.json()["cancel_requested_at"]
    assert _state(run) == before
    assert run.events.filter(type="run.finished").count() == 1


def test_an_auditor_may_not_cancel_a_run(client_for, acme, auditor, member, start_run, acme_agent):
    run = start_run(member)
    before = _state(run)

    response = client_for(auditor, acme).post(f"{RUNS}/{run.pk}/cancel")

    assert response.status_code == 403
    assert _error(response)["code"] == "PERMISSION_DENIED"
    assert _state(run) == before
    assert before[0] == "QUEUED"


def test_a_tenant_admin_may_cancel_another_user_s_run(
    client_for, acme, tenant_admin, member, start_run, acme_agent
):
    run = start_run(member)

    response = client_for(tenant_admin, acme).post(f"{RUNS}/{run.pk}/cancel")

    assert response.status_code == 200
    run.refresh_from_db()
    assert (run.status, run.reason_code) == ("CANCELLED", "CANCELLED_BY_USER")
    assert run.events.get(seq=5).payload == {
        "status": "CANCELLED",
        "reason_code": "CANCELLED_BY_USER",
        "cancelled_by": "ada",
    }


def test_the_run_names_who_cancelled_it(
    alice, client_for, acme, tenant_admin, member, start_run, acme_agent
):
    # given two of alice's runs, one of them cancelled by a tenant admin
    cancelled, other = start_run(member), start_run(member)

    response = client_for(tenant_admin, acme).post(f"{RUNS}/{cancelled.pk}/cancel")

    # then the answer, the run and the list name the admin; the other run names no one
    assert response.status_code == 200
    assert response.json()["cancelled_by"] == "ada"
    assert alice.get(f"{RUNS}/{cancelled.pk}").json()["cancelled_by"] == "ada"
    listed = {run["id"]: run["cancelled_by"] for run in alice.get(RUNS).json()["results"]}
    assert listed == {str(cancelled.pk): "ada", str(other.pk): None}


def test_a_refused_run_cannot_be_cancelled(client_for, acme, member, start_run):
    # given a run refused at ingress (acme has no agent)
    run = start_run(member)
    assert run.status == "REFUSED"
    before = _state(run)

    response = client_for(member, acme).post(f"{RUNS}/{run.pk}/cancel")

    assert response.status_code == 409
    assert _error(response)["code"] == "INVALID_STATUS_TRANSITION"
    assert _state(run) == before


def test_cancelling_a_running_run_marks_it_for_the_next_step(alice, member, start_run):
    run = _set_status(start_run(member), RunStatus.RUNNING)
    before_log = event_log(run)

    response = alice.post(f"{RUNS}/{run.pk}/cancel")

    assert response.status_code == 200
    run.refresh_from_db()
    assert run.status == "RUNNING"
    assert run.cancel_requested_at is not None
    assert run.finished_at is None
    assert event_log(run) == before_log


def test_cancel_answers_only_post(alice, member, start_run):
    run = start_run(member)

    response = alice.get(f"{RUNS}/{run.pk}/cancel")

    assert response.status_code == 405
    assert Run.objects.get(pk=run.pk).status == "QUEUED"


def test_the_list_s_filters_leave_one_run_its_events_and_its_cancel_alone(alice, member, start_run):
    # given a queued run, and a query of the list's filters it does not match
    run = start_run(member)
    query = "?status=COMPLETED&skill=other"

    # when one run, its events and its cancel are asked for with that query
    one = alice.get(f"{RUNS}/{run.pk}{query}")
    events = alice.get(f"{RUNS}/{run.pk}/events{query}")
    cancelled = alice.post(f"{RUNS}/{run.pk}/cancel{query}")

    # then they answer for the run, as without it; the list alone is filtered
    assert (one.status_code, one.json()["id"]) == (200, str(run.pk))
    assert (events.status_code, events.json()["count"]) == (200, 4)
    assert (cancelled.status_code, cancelled.json()["status"]) == (200, "CANCELLED")
    assert alice.get(f"{RUNS}{query}").json()["count"] == 0


def test_the_schema_gives_the_run_events_no_parameters_of_the_run_list(alice):
    schema = alice.get("/api/schema/", {"format": "json"}).json()

    def parameters(path: str) -> set[str]:
        return {parameter["name"] for parameter in schema["paths"][path]["get"]["parameters"]}

    assert parameters("/api/v1/runs/{id}/events") == {"id", "after", "page", "page_size"}
    assert {"status", "session", "skill"} <= parameters("/api/v1/runs")


def test_sources_fetched_in_the_same_instant_are_listed_in_the_order_they_were_made(demo, client):
    # given a run of alice's with three sources fetched in the same instant, stored in the
    # reverse of the order they were made, their references in the reverse of that too
    run = demo_run(demo, project_id="apollo")
    references = ["doc:2", "doc:1", "doc:0"]
    made = [
        Source(run=run, origin="project_search@1.0.0", reference=reference, content_hash="0" * 64)
        for reference in references
    ]
    Source.objects.bulk_create(reversed(made))
    Source.objects.filter(run=run).update(fetched_at=timezone.now())
    run_cancel(run=Run.objects.get(pk=run.pk), actor=demo.alice)

    # when alice reads the run in the API, and an admin on its page and in its export
    result = api_as("alice").get(f"{RUNS}/{run.pk}").json()["result"]
    client.force_login(demo.admin)
    page = client.get(reverse("runs:detail", args=[run.pk])).content.decode()
    export = client.get(reverse("runs:export", args=[run.pk])).json()

    # then each lists them in the order they were made
    assert [source["reference"] for source in result["sources"]] == references
    assert sorted(references, key=page.index) == references
    assert [source["reference"] for source in export["sources"]] == references
