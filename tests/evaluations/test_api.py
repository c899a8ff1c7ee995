"""The evaluations API: suites, starting and following eval runs, their results; scoped to
the token's tenant and to those who may evaluate the skill."""

import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from evaluations import services
from evaluations.choices import EvalRunStatus
from evaluations.models import EvalRun
from evaluations.starter import suite_install
from registry.choices import ModelProvider
from registry.models import ModelConfig, SkillVersion, Tenant
from registry.services import skills
from registry.services.common import registry_object_save
from tests.approvals.conftest import approver_in
from tests.evaluations.conftest import TINY_SUITE, api_as


def start_body(suites, **changes):
    return {
        "suite": str(suites["weekly-summary-tasks"].pk),
        "skill_version": str(SkillVersion.objects.get(skill__name="weekly-summary").pk),
        "agent": "weekly-reporter",
        **changes,
    }


def test_a_publisher_starts_an_eval_run_and_reads_its_results(demo, suites):
    client = api_as("dave", demo.acme)

    listed = client.get("/api/v1/evaluations/suites").json()
    started = client.post("/api/v1/evaluations/runs", start_body(suites), format="json")

    assert {suite["key"]: suite["case_count"] for suite in listed["results"]} == {
        "weekly-summary-tasks": 22,
        "prompt-injection-attacks": 30,
    }
    assert started.status_code == 201
    body = started.json()
    assert (body["status"], body["cases_total"], body["skill_version"]) == (
        "queued",
        22,
        "weekly-summary@3.2.0",
    )
    services.eval_run_advance(eval_run_id=body["id"])
    detail = client.get(f"/api/v1/evaluations/runs/{body['id']}").json()
    results = client.get(f"/api/v1/evaluations/runs/{body['id']}/results").json()
    assert (detail["status"], detail["cases_done"]) == ("completed", 22)
    assert detail["metrics"]["case_pass_rate"] == 1.0
    assert "case_pass_rate" in detail["metric_definitions"]
    assert results["count"] == 22
    assert results["results"][0]["case"] == "ambiguous-lead"


def test_a_start_sent_again_gets_the_eval_run_still_queued_instead_of_a_second(
    demo, suites, adversary
):
    client = api_as("dave", demo.acme)
    first = client.post("/api/v1/evaluations/runs", start_body(suites), format="json")

    # when the same request is sent again while the first eval run is queued
    again = client.post("/api/v1/evaluations/runs", start_body(suites), format="json")
    # and with another model, which is another measure
    other_model = client.post(
        "/api/v1/evaluations/runs", start_body(suites, model_config="adversary"), format="json"
    )

    assert (first.status_code, again.status_code, other_model.status_code) == (201, 200, 201)
    assert again.json()["id"] == first.json()["id"] != other_model.json()["id"]
    assert EvalRun.objects.count() == 2

    # once it has finished, the same request measures again
    services.eval_run_advance(eval_run_id=first.json()["id"])
    later = client.post("/api/v1/evaluations/runs", start_body(suites), format="json")
    assert later.status_code == 201
    assert later.json()["id"] not in (first.json()["id"], other_model.json()["id"])


def test_a_start_sent_again_after_the_suite_changed_and_changed_back_starts_a_new_eval_run(
    demo, suites
):
    client = api_as("dave", demo.acme)
    first = client.post("/api/v1/evaluations/runs", start_body(suites), format="json")

    # when a case of the suite is changed and changed back while the first eval run is queued
    case = suites["weekly-summary-tasks"].cases.get(key="complete-en")
    messages = case.messages
    case.messages = ["Summarise Apollo's week."]
    services.eval_case_save(case=case, actor=demo.admin)
    case.messages = messages
    services.eval_case_save(case=case, actor=demo.admin)
    again = client.post("/api/v1/evaluations/runs", start_body(suites), format="json")

    # then the first, which no release gate counts, is not given for the second start
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.json()["id"] != first.json()["id"]


def test_bad_references_are_400_and_start_nothing(demo, suites):
    client = api_as("dave", demo.acme)

    unknown = client.post(
        "/api/v1/evaluations/runs",
        start_body(suites, agent="nobody", model_config="no-such-model"),
        format="json",
    )
    extra = client.post("/api/v1/evaluations/runs", start_body(suites, admin=True), format="json")
    malformed = client.post(
        "/api/v1/evaluations/runs", start_body(suites, suite="not-a-uuid"), format="json"
    )
    numbers = client.post(
        "/api/v1/evaluations/runs",
        start_body(suites, suite=1, skill_version=2, agent=3, model_config=4),
        format="json",
    )

    assert unknown.status_code == 400
    assert set(unknown.json()["error"]["details"]) == {"agent_config", "model_config"}
    assert extra.status_code == 400
    assert malformed.status_code == 400
    assert numbers.status_code == 400
    assert set(numbers.json()["error"]["details"]) == {
        "suite",
        "skill_version",
        "agent",
        "model_config",
    }
    assert not EvalRun.objects.exists()


@pytest.mark.parametrize("switched_off", ["agent", "its model", "the model named"])
def test_an_agent_or_model_switched_off_is_not_evaluated(demo, suites, switched_off):
    agent = demo.acme.agent_configs.get(name="weekly-reporter")
    other = registry_object_save(
        instance=ModelConfig(
            tenant=demo.acme,
            name="other-model",
            provider=ModelProvider.OFFLINE,
            model_name="offline-deterministic-planner",
        ),
        actor=demo.admin,
    )
    off = {"agent": agent, "its model": agent.model_config, "the model named": other}
    off[switched_off].is_active = False
    registry_object_save(instance=off[switched_off], actor=demo.admin, reason="switched off")
    body = start_body(suites)
    if switched_off == "the model named":
        body["model_config"] = "other-model"

    response = api_as("dave", demo.acme).post("/api/v1/evaluations/runs", body, format="json")

    assert response.status_code == 400
    field = "agent_config" if switched_off == "agent" else "model_config"
    assert response.json()["error"]["details"] == {
        field: [f"{off[switched_off].name} is not active."]
    }
    assert not EvalRun.objects.exists()


@pytest.mark.parametrize(
    "owners", [(None, "acme"), ("acme", None)], ids=["platform-first", "tenant-first"]
)
def test_a_model_named_by_both_the_tenant_and_the_platform_is_the_tenant_s(demo, suites, owners):
    configs = {
        owner: registry_object_save(
            instance=ModelConfig(
                tenant=demo.acme if owner else None,
                name="shared-model",
                provider=ModelProvider.OFFLINE,
                model_name="offline-deterministic-planner",
            ),
            actor=demo.admin,
        )
        for owner in owners
    }
    client = api_as("dave", demo.acme)

    started = client.post(
        "/api/v1/evaluations/runs", start_body(suites, model_config="shared-model"), format="json"
    )

    assert started.status_code == 201
    assert EvalRun.objects.get(pk=started.json()["id"]).model_config == configs["acme"]


def test_members_and_other_tenants_neither_start_nor_see_eval_runs(demo, suites):
    eval_run, _ = services.eval_run_start(
        actor=demo.admin,
        suite=suites["weekly-summary-tasks"],
        skill_version=SkillVersion.objects.get(skill__name="weekly-summary"),
        agent_config=demo.agent,
    )
    globex = Tenant.objects.get(slug="globex")
    outsider = approver_in(globex, "quinn")

    member = api_as("alice", demo.acme)
    refused = member.post("/api/v1/evaluations/runs", start_body(suites), format="json")
    foreign = api_as(outsider.username, globex).get(f"/api/v1/evaluations/runs/{eval_run.pk}")
    foreign_cancel = api_as(outsider.username, globex).post(
        f"/api/v1/evaluations/runs/{eval_run.pk}/cancel", {"bogus": 1}, format="json"
    )

    assert refused.status_code == 403
    assert member.get("/api/v1/evaluations/runs").json()["results"] == []
    assert member.get(f"/api/v1/evaluations/runs/{eval_run.pk}").status_code == 404
    assert foreign.status_code == 404
    assert foreign.json()["error"]["message"] == "No such eval run."
    assert foreign_cancel.status_code == 404
    assert EvalRun.objects.count() == 1


def test_a_cancelled_eval_run_stops_between_cases(demo, suites):
    client = api_as("dave", demo.acme)
    eval_run_id = client.post("/api/v1/evaluations/runs", start_body(suites), format="json").json()[
        "id"
    ]

    cancelled = client.post(f"/api/v1/evaluations/runs/{eval_run_id}/cancel")
    services.eval_run_advance(eval_run_id=eval_run_id)

    assert cancelled.json()["status"] == EvalRunStatus.CANCELLED
    assert EvalRun.objects.get(pk=eval_run_id).results.count() == 0
    again = client.post(f"/api/v1/evaluations/runs/{eval_run_id}/cancel")
    assert (again.status_code, again.json()["status"]) == (200, EvalRunStatus.CANCELLED)


def test_a_cancel_with_a_body_it_does_not_read_is_refused_and_an_empty_object_cancels(demo, suites):
    client = api_as("dave", demo.acme)
    eval_run_id = client.post("/api/v1/evaluations/runs", start_body(suites), format="json").json()[
        "id"
    ]
    cancel = f"/api/v1/evaluations/runs/{eval_run_id}/cancel"

    malformed = client.post(cancel, "{{{", content_type="application/json")
    unknown = client.post(cancel, {"reason": "late"}, format="json")
    status_after_refusals = EvalRun.objects.get(pk=eval_run_id).status
    empty = client.post(cancel, {}, format="json")

    assert (malformed.status_code, unknown.status_code) == (400, 400)
    assert malformed.json()["error"]["code"] == "VALIDATION_ERROR"
    assert unknown.json()["error"]["details"] == {"reason": ["Unknown field."]}
    assert status_after_refusals == EvalRunStatus.QUEUED
    assert (empty.status_code, empty.json()["status"]) == (200, EvalRunStatus.CANCELLED)


def test_a_cancel_that_comes_while_a_case_runs_keeps_its_result_and_counts_it(
    demo, suites, monkeypatch
):
    # given an eval run cancelled while its first case runs
    client = api_as("dave", demo.acme)
    eval_run_id = client.post("/api/v1/evaluations/runs", start_body(suites), format="json").json()[
        "id"
    ]
    case_run = services._case_run

    def cancelled_meanwhile(eval_run, case):
        run = case_run(eval_run, case)
        client.post(f"/api/v1/evaluations/runs/{eval_run_id}/cancel")
        return run

    monkeypatch.setattr(services, "_case_run", cancelled_meanwhile)

    # when the runner finishes that case
    services.eval_run_advance(eval_run_id=eval_run_id)

    # then it stops there, and its progress counts the result it kept
    shown = client.get(f"/api/v1/evaluations/runs/{eval_run_id}").json()
    assert shown["status"] == EvalRunStatus.CANCELLED
    assert shown["cases_done"] == EvalRun.objects.get(pk=eval_run_id).results.count() == 1


def test_listing_suites_costs_the_same_queries_for_two_suites_or_three(demo, suites):
    client = api_as("dave", demo.acme)
    with CaptureQueriesContext(connection) as two:
        client.get("/api/v1/evaluations/suites")
    suite_install({**TINY_SUITE, "key": "third"})
    with CaptureQueriesContext(connection) as three:
        listed = client.get("/api/v1/evaluations/suites").json()

    assert listed["count"] == 3
    assert len(three.captured_queries) == len(two.captured_queries)


def test_a_revoked_version_is_not_evaluated(demo, suites, dave):
    version = SkillVersion.objects.get(skill__name="weekly-summary", version="3.2.0")
    skills.skill_version_revoke(skill_version=version, actor=dave, reason="leaks data")

    response = api_as("dave", demo.acme).post(
        "/api/v1/evaluations/runs", start_body(suites), format="json"
    )

    assert response.status_code == 400
    assert response.json()["error"]["details"] == {
        "skill_version": ["weekly-summary@3.2.0 is revoked: no run may use it."]
    }
    assert not EvalRun.objects.exists()


def test_an_unknown_eval_run_is_said_alike_whatever_its_id(demo):
    client = api_as("dave", demo.acme)

    answers = [
        client.get(path)
        for path in (
            "/api/v1/evaluations/runs/not-an-id",
            f"/api/v1/evaluations/runs/{uuid.uuid4()}",
            f"/api/v1/evaluations/runs/{uuid.uuid4()}/results",
        )
    ]

    assert [answer.status_code for answer in answers] == [404, 404, 404]
    assert {answer.json()["error"]["message"] for answer in answers} == {"No such eval run."}
