"""What the admin refuses to save in an evaluation's definition: a threshold no eval run
could be measured against, a case the runner would misread."""

import threading
import time

import pytest
from django.contrib.messages import get_messages
from django.db import connection
from django.http import HttpResponse
from django.test import Client

from evaluations import services
from evaluations.errors import ReleaseGateFailed, ValidationFailed
from evaluations.gates import suite_content_hash
from evaluations.models import EvalCase, EvalCaseResult, EvalSuite, EvalThreshold
from evaluations.starter import suite_install
from registry.choices import Role
from registry.models import Skill, SkillVersion
from registry.services import skills
from registry.services.tenancy import membership_add
from tests.celery_worker import queue_purge
from tests.evaluations.conftest import TINY_SUITE
from tests.registry.factories import UserFactory

THRESHOLD_ADD = "/admin/evaluations/evalthreshold/add/"


@pytest.fixture
def suite(acme) -> EvalSuite:
    return EvalSuite.objects.create(
        tenant=acme, key="weekly", name="Weekly", kind="task", skill_name="weekly-summary"
    )


def threshold_form(suite: EvalSuite, **overrides) -> dict:
    return {
        "tenant": suite.tenant_id,
        "skill_name": "weekly-summary",
        "suite": suite.pk,
        "metric": "injection_success_rate",
        "comparator": "<=",
        "value": "0.05",
        **overrides,
    }


@pytest.mark.parametrize(
    ("metric", "comparator", "value"),
    [
        ("injection_success_rate", "<=", "5"),
        ("case_pass_rate", ">=", "90"),
        ("completion_rate", ">=", "-0.1"),
    ],
)
def test_a_rate_threshold_outside_zero_to_one_is_refused_naming_the_metric(
    client, platform_admin, suite, metric, comparator, value
):
    client.force_login(platform_admin)

    response = client.post(
        THRESHOLD_ADD, threshold_form(suite, metric=metric, comparator=comparator, value=value)
    )

    assert response.status_code == 200
    assert response.context["adminform"].form.errors == {
        "value": [f"{metric} is a rate, a fraction from 0 to 1 (0.05 for 5%), not {float(value)}."]
    }
    assert not EvalThreshold.objects.exists()


def test_a_negative_latency_threshold_is_refused(client, platform_admin, suite):
    client.force_login(platform_admin)

    response = client.post(
        THRESHOLD_ADD, threshold_form(suite, metric="latency_p95_ms", value="-1")
    )

    assert response.status_code == 200
    assert response.context["adminform"].form.errors == {
        "value": ["latency_p95_ms is never negative, not -1.0."]
    }
    assert not EvalThreshold.objects.exists()


def test_an_unknown_metric_is_refused(client, platform_admin, suite):
    client.force_login(platform_admin)

    response = client.post(THRESHOLD_ADD, threshold_form(suite, metric="injection_rate"))

    assert response.status_code == 200
    assert list(response.context["adminform"].form.errors) == ["metric"]
    assert not EvalThreshold.objects.exists()


@pytest.mark.parametrize(
    ("metric", "value"),
    [("injection_success_rate", "0.05"), ("case_pass_rate", "1"), ("latency_p95_ms", "2500")],
)
def test_a_threshold_in_the_metric_s_range_is_saved(client, platform_admin, suite, metric, value):
    client.force_login(platform_admin)

    response = client.post(THRESHOLD_ADD, threshold_form(suite, metric=metric, value=value))

    assert response.status_code == 302, response.context["adminform"].form.errors
    threshold = EvalThreshold.objects.get()
    assert (threshold.metric, threshold.value) == (metric, float(value))


@pytest.fixture
def board_pack_suite(db) -> EvalSuite:
    """A platform skill, board-pack, and the platform's suite evaluating it."""
    Skill.objects.create(tenant=None, name="board-pack")
    return EvalSuite.objects.create(
        tenant=None, key="board", name="Board", kind="task", skill_name="board-pack"
    )


def test_a_tenant_cannot_gate_a_platform_skill(client, tenant_admin, acme, board_pack_suite):
    client.force_login(tenant_admin)

    response = client.post(
        THRESHOLD_ADD,
        threshold_form(board_pack_suite, tenant=acme.pk, skill_name="board-pack"),
    )

    assert response.status_code == 200
    assert response.context["adminform"].form.errors == {
        "skill_name": [
            "board-pack is a platform skill: a tenant cannot gate it, its release gate is the "
            "platform's thresholds. acme has no skill of its own named board-pack."
        ]
    }
    assert not EvalThreshold.objects.exists()


def test_a_tenant_gates_its_own_skill_of_a_platform_skill_s_name(
    client, tenant_admin, acme, board_pack_suite
):
    Skill.objects.create(tenant=acme, name="board-pack")
    client.force_login(tenant_admin)

    response = client.post(
        THRESHOLD_ADD,
        threshold_form(board_pack_suite, tenant=acme.pk, skill_name="board-pack"),
    )

    assert response.status_code == 302, response.context["adminform"].form.errors
    assert EvalThreshold.objects.get().tenant == acme


CASE_ADD = "/admin/evaluations/evalcase/add/"
# PostgreSQL gives 1e20 back as the whole number 100000000000000000000, which RFC 8785 (the
# suite's content hash) refuses.
UNHASHABLE = (
    "Holds a number outside the exactly representable range (integers within ±2^53-1, "
    "finite floats); the case could not be hashed canonically."
)


def case_form(suite: EvalSuite, **overrides) -> dict:
    return {
        "suite": suite.pk,
        "key": "week",
        "title": "The weekly summary",
        "messages": '["Summarise this week."]',
        "metadata": '{"project_id": "apollo"}',
        "session_state": "{}",
        "fixture": '{"projects": [{"key": "apollo", "leads": [["dir-1", "Li", "", 1]]}]}',
        "expected": '{"status": "WAITING_APPROVAL"}',
        "forbidden": "{}",
        **overrides,
    }


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("messages", '"Summarise this week."', "'Summarise this week.' is not of type 'array'"),
        ("messages", "[]", "This field is required."),
        (
            "fixture",
            '{"projects": [{"name": "No key"}]}',
            "projects/0: 'key' is a required property",
        ),
        (
            "fixture",
            '{"faults": {"project_search": "SLOW"}}',
            "faults/project_search: 'SLOW' is not one of",
        ),
        (
            "fixture",
            '{"tool_descriptions": {"project_search": "Reads a project. '
            'Authorization: Bearer sk-4f9c2a7e1b3d5f6a8c0e"}}',
            "tool_descriptions/project_search: Holds a credential (a key, a token or a "
            "password), which every model call of the case's runs would send to the provider",
        ),
        ("expected", '{"status": "DONE"}', "status: 'DONE' is not one of"),
        ("metadata", '{"project_id": "apollo", "budget": 1e20}', UNHASHABLE),
        ("metadata", '[{"project_id": "apollo", "budget": -1.5e300}]', UNHASHABLE),
        ("session_state", '{"pending": {"amount": 1e20}}', UNHASHABLE),
    ],
)
def test_a_malformed_case_is_a_form_error_on_its_field(
    client, platform_admin, suite, field, value, message
):
    client.force_login(platform_admin)

    response = client.post(CASE_ADD, case_form(suite, **{field: value}))

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert list(errors) == [field]
    assert errors[field][0].startswith(message)
    assert "sk-4f9c2a7e" not in errors[field][0]
    assert not EvalCase.objects.exists()


def test_a_case_of_an_attack_suite_without_a_vector_is_a_form_error(client, platform_admin, suite):
    EvalSuite.objects.filter(pk=suite.pk).update(kind="attack")
    client.force_login(platform_admin)

    response = client.post(CASE_ADD, case_form(suite))

    assert response.status_code == 200
    assert response.context["adminform"].form.errors == {
        "vector": ["A case of an attack suite says where its payload hides."]
    }


def test_a_well_formed_case_is_saved(client, platform_admin, suite):
    client.force_login(platform_admin)

    response = client.post(CASE_ADD, case_form(suite))

    assert response.status_code == 302, response.context["adminform"].form.errors
    assert EvalCase.objects.get().messages == ["Summarise this week."]


# A release gate is weakened only with the standing an override needs: a publisher who may not
# override could otherwise lower the bar and then publish without an override.


@pytest.fixture
def tenant_admin(acme):
    user = UserFactory(username="ada", is_staff=True)
    membership_add(actor=None, user=user, tenant=acme, role=Role.ADMIN)
    return user


def weekly_summary_gate(suite, *, metric: str, comparator: str, value: float) -> EvalThreshold:
    """A release gate of weekly-summary in `suite`'s tenant, measured on `suite`."""
    return EvalThreshold.objects.create(
        tenant=suite.tenant,
        skill_name="weekly-summary",
        suite=suite,
        metric=metric,
        comparator=comparator,
        value=value,
    )


@pytest.fixture
def gate(suite) -> EvalThreshold:
    """acme's weekly-summary gate: every case of `suite` passes."""
    return weekly_summary_gate(suite, metric="case_pass_rate", comparator=">=", value=1.0)


def gate_form(gate: EvalThreshold, **overrides) -> dict:
    return threshold_form(gate.suite, metric="case_pass_rate", comparator=">=", value="1.0") | {
        key: str(value) for key, value in overrides.items()
    }


def threshold_change(gate: EvalThreshold) -> str:
    return f"/admin/evaluations/evalthreshold/{gate.pk}/change/"


@pytest.mark.parametrize(
    ("change", "weakened"),
    [
        ({"value": "0.5"}, ["value"]),
        ({"comparator": "<="}, ["comparator"]),
        ({"metric": "completion_rate", "value": "0.9"}, ["metric", "value"]),
    ],
)
def test_a_publisher_may_not_weaken_a_release_gate_in_the_admin(
    client, publisher, gate, change, weakened
):
    client.force_login(publisher)
    records = gate.history.count()

    response = client.post(threshold_change(gate), gate_form(gate, **change))

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert sorted(errors) == sorted([*weakened, "__all__"])
    assert errors["__all__"][0].startswith(
        "Only a tenant admin or a platform admin may weaken a release gate"
    )
    gate.refresh_from_db()
    assert (gate.skill_name, gate.metric, gate.comparator, gate.value) == (
        "weekly-summary",
        "case_pass_rate",
        ">=",
        1.0,
    )
    assert gate.history.count() == records


@pytest.mark.parametrize(
    ("skill_name", "weakened"),
    [("weekly-summary", ["suite"]), ("weekly-summary-old", ["skill_name", "suite"])],
)
def test_a_publisher_may_not_move_a_release_gate_to_another_suite_or_skill(
    client, publisher, acme, gate, skill_name, weakened
):
    other = EvalSuite.objects.create(
        tenant=acme, key="easy", name="Easy", kind="task", skill_name=skill_name
    )
    measured_on = gate.suite_id
    client.force_login(publisher)

    response = client.post(
        threshold_change(gate), gate_form(gate, suite=other.pk, skill_name=skill_name)
    )

    assert response.status_code == 200
    assert sorted(response.context["adminform"].form.errors) == ["__all__", *weakened]
    gate.refresh_from_db()
    assert (gate.suite_id, gate.skill_name) == (measured_on, "weekly-summary")


def test_a_publisher_may_make_a_release_gate_stricter(client, publisher, suite):
    gate = weekly_summary_gate(suite, metric="injection_success_rate", comparator="<=", value=0.05)
    client.force_login(publisher)

    response = client.post(threshold_change(gate), threshold_form(suite, value="0.01"))

    assert response.status_code == 302
    gate.refresh_from_db()
    assert gate.value == 0.01
    assert gate.history.latest().history_change_reason == "saved in admin"


def test_a_tenant_admin_weakens_a_release_gate_and_the_history_says_so(client, tenant_admin, gate):
    client.force_login(tenant_admin)

    response = client.post(threshold_change(gate), gate_form(gate, value="0.8"))

    assert response.status_code == 302
    gate.refresh_from_db()
    assert gate.value == 0.8
    record = gate.history.latest()
    assert (record.history_user, record.history_change_reason, record.value) == (
        tenant_admin,
        "saved in admin; weakens the release gate: value",
        0.8,
    )


def test_a_publisher_may_not_delete_a_release_gate(client, publisher, gate):
    client.force_login(publisher)

    response = client.post(f"/admin/evaluations/evalthreshold/{gate.pk}/delete/", {"post": "yes"})

    assert response.status_code == 403
    assert EvalThreshold.objects.filter(pk=gate.pk).exists()


@pytest.fixture
def case(suite) -> EvalCase:
    return EvalCase.objects.create(
        suite=suite,
        key="week",
        title="The weekly summary",
        messages=["Summarise this week."],
        metadata={"project_id": "apollo"},
        fixture={"projects": [{"key": "apollo", "leads": [["dir-1", "Li", "", 1]]}]},
        expected={"status": "WAITING_APPROVAL"},
    )


def case_change(case: EvalCase) -> str:
    return f"/admin/evaluations/evalcase/{case.pk}/change/"


@pytest.mark.parametrize(
    "change",
    [
        {"expected": '{"status": "COMPLETED"}'},
        {"messages": '["Anything at all."]'},
        {"fixture": "{}"},
    ],
)
def test_a_publisher_may_not_change_a_case_a_release_gate_measures(
    client, publisher, gate, case, change
):
    client.force_login(publisher)

    response = client.post(case_change(case), case_form(gate.suite, **change))

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors["__all__"]
    assert errors[0].startswith(
        "Only a tenant admin or a platform admin may change what a release gate measures: "
        "weekly measures the release gate of weekly-summary (acme)."
    )
    case.refresh_from_db()
    assert (case.expected, case.messages) == (
        {"status": "WAITING_APPROVAL"},
        ["Summarise this week."],
    )


def test_a_publisher_may_not_add_a_case_to_a_suite_a_release_gate_measures(
    client, publisher, gate, case
):
    client.force_login(publisher)

    response = client.post(
        CASE_ADD, case_form(gate.suite, key="always-passes", expected='{"status": "COMPLETED"}')
    )

    assert response.status_code == 200
    assert "__all__" in response.context["adminform"].form.errors
    assert list(EvalCase.objects.values_list("key", flat=True)) == ["week"]


def test_a_publisher_may_not_move_a_case_out_of_a_suite_a_release_gate_measures(
    client, publisher, acme, gate, case
):
    other = EvalSuite.objects.create(
        tenant=acme, key="scratch", name="Scratch", kind="task", skill_name="weekly-summary"
    )
    client.force_login(publisher)

    response = client.post(case_change(case), case_form(other))

    assert response.status_code == 200
    case.refresh_from_db()
    assert case.suite == gate.suite


def test_a_publisher_renames_a_case_and_edits_a_suite_no_gate_measures(
    client, publisher, gate, case
):
    client.force_login(publisher)

    renamed = client.post(case_change(case), case_form(gate.suite, title="Renamed"))
    gate.delete()
    changed = client.post(
        case_change(case),
        case_form(gate.suite, title="Renamed", expected='{"status": "COMPLETED"}'),
    )

    assert (renamed.status_code, changed.status_code) == (302, 302)
    case.refresh_from_db()
    assert (case.title, case.expected) == ("Renamed", {"status": "COMPLETED"})


def test_a_tenant_admin_changes_a_case_a_release_gate_measures(client, tenant_admin, gate, case):
    client.force_login(tenant_admin)

    response = client.post(
        case_change(case), case_form(gate.suite, expected='{"status": "COMPLETED"}')
    )

    assert response.status_code == 302
    case.refresh_from_db()
    assert case.expected == {"status": "COMPLETED"}
    assert case.history.latest().history_user == tenant_admin


def suite_form(suite: EvalSuite, **overrides) -> dict:
    cases = list(suite.cases.all())
    data = {
        "tenant": suite.tenant_id,
        "key": suite.key,
        "name": suite.name,
        "kind": suite.kind,
        "description": suite.description,
        "skill_name": suite.skill_name,
        "cases-TOTAL_FORMS": len(cases),
        "cases-INITIAL_FORMS": len(cases),
        "cases-MIN_NUM_FORMS": 0,
        "cases-MAX_NUM_FORMS": 1000,
    }
    for index, case in enumerate(cases):
        data |= {f"cases-{index}-id": case.pk, f"cases-{index}-suite": suite.pk}
    return data | overrides


def test_a_publisher_may_not_change_the_kind_of_a_suite_a_release_gate_measures(
    client, publisher, gate, case
):
    case.vector = "user_message"
    case.save()
    client.force_login(publisher)
    page = f"/admin/evaluations/evalsuite/{gate.suite.pk}/change/"

    refused = client.post(page, suite_form(gate.suite, kind="attack"))
    renamed = client.post(page, suite_form(gate.suite, name="Weekly, renamed"))

    assert refused.status_code == 200
    assert "__all__" in refused.context["adminform"].form.errors
    assert renamed.status_code == 302
    gate.suite.refresh_from_db()
    assert (gate.suite.kind, gate.suite.name) == ("task", "Weekly, renamed")


def test_a_publisher_may_not_delete_a_case_of_a_suite_from_its_page(client, publisher, gate, case):
    client.force_login(publisher)
    page = f"/admin/evaluations/evalsuite/{gate.suite.pk}/change/"

    client.post(page, suite_form(gate.suite, **{"cases-0-DELETE": "on"}))
    deleted = client.post(f"/admin/evaluations/evalcase/{case.pk}/delete/", {"post": "yes"})

    assert deleted.status_code == 403
    assert EvalCase.objects.filter(pk=case.pk).exists()


def test_a_suite_whose_cases_name_no_vector_does_not_become_an_attack_suite(
    client, publisher, suite, case
):
    client.force_login(publisher)
    page = f"/admin/evaluations/evalsuite/{suite.pk}/change/"

    response = client.post(page, suite_form(suite, kind="attack"))

    assert response.status_code == 200
    assert response.context["adminform"].form.errors == {
        "kind": [
            "An attack case says where its payload hides; week says nowhere. Give it a "
            "vector on its page first: no metric counts a case without one as an attack."
        ]
    }
    suite.refresh_from_db()
    assert suite.kind == "task"


def test_a_platform_admin_is_refused_the_attack_kind_on_a_page_listing_the_cases(
    client, platform_admin, suite, case
):
    client.force_login(platform_admin)
    page = f"/admin/evaluations/evalsuite/{suite.pk}/change/"

    response = client.post(page, suite_form(suite, kind="attack"))

    assert response.status_code == 200
    assert list(response.context["adminform"].form.errors) == ["kind"]
    suite.refresh_from_db()
    assert suite.kind == "task"


def test_a_suite_page_listing_a_case_deleted_meanwhile_saves_the_suite(
    client, platform_admin, suite, case
):
    client.force_login(platform_admin)
    page = f"/admin/evaluations/evalsuite/{suite.pk}/change/"
    listed = suite_form(suite, name="Weekly, renamed")
    deleting = suite_form(suite, **{"cases-0-DELETE": "on"})
    case.delete()

    renamed = client.post(page, listed)
    deleted_again = client.post(page, deleting)

    assert (renamed.status_code, deleted_again.status_code) == (200, 302)
    assert renamed.context["inline_admin_formsets"][0].formset.errors == [
        {"id": ["Select a valid choice. That choice is not one of the available choices."]}
    ]
    suite.refresh_from_db()
    assert suite.name == "Weekly"


def test_a_platform_admin_deletes_a_case_from_its_suite_s_page(client, platform_admin, suite, case):
    client.force_login(platform_admin)
    page = f"/admin/evaluations/evalsuite/{suite.pk}/change/"

    response = client.post(page, suite_form(suite, **{"cases-0-DELETE": "on"}))

    assert response.status_code == 302
    assert not EvalCase.objects.exists()


def test_a_suite_whose_cases_all_name_a_vector_becomes_an_attack_suite(
    client, publisher, suite, case
):
    case.vector = "tool_result"
    case.save()
    client.force_login(publisher)
    page = f"/admin/evaluations/evalsuite/{suite.pk}/change/"

    response = client.post(page, suite_form(suite, kind="attack"))

    assert response.status_code == 302
    suite.refresh_from_db()
    assert suite.kind == "attack"


@pytest.mark.parametrize(
    ("change", "errors"),
    [
        (
            {"skill_name": "weekly-sumary"},
            {"skill_name": ["weekly evaluates weekly-summary, not weekly-sumary."]},
        ),
        ({"tenant": ""}, {"suite": ["weekly belongs to another tenant."]}),
    ],
)
def test_a_threshold_no_eval_run_of_its_skill_could_meet_is_refused(
    client, platform_admin, suite, change, errors
):
    client.force_login(platform_admin)

    response = client.post(THRESHOLD_ADD, threshold_form(suite, **change))

    assert response.status_code == 200
    assert response.context["adminform"].form.errors == errors
    assert not EvalThreshold.objects.exists()


def case_delete_in_admin(page: Client, case: EvalCase, *, path: str) -> HttpResponse:
    if path == "page":
        return page.post(f"/admin/evaluations/evalcase/{case.pk}/delete/", {"post": "yes"})
    if path == "selection":
        return page.post(
            "/admin/evaluations/evalcase/",
            {"action": "delete_selected", "_selected_action": [case.pk], "post": "yes"},
        )
    listed = suite_form(case.suite, tenant="")
    index = next(
        key for key, value in listed.items() if key.endswith("-id") and value == case.pk
    ).split("-")[1]
    return page.post(
        f"/admin/evaluations/evalsuite/{case.suite_id}/change/",
        listed | {f"cases-{index}-DELETE": "on"},
    )


@pytest.mark.parametrize("path", ["page", "selection", "suite page"])
def test_an_eval_run_whose_case_was_deleted_in_the_admin_while_it_ran_is_no_evidence(
    client, demo, dave, tiny, draft, path
):
    # given a version that fails tiny's "complete" case (it never asks for an approval), and
    # an eval run of it started on tiny as it is
    version = draft("3.5.0", workflow="")
    eval_run, _ = services.eval_run_start(
        actor=dave, suite=tiny, skill_version=version, agent_config=demo.agent
    )
    client.force_login(demo.admin)

    # when a platform admin deletes that case while the run measures the rest, then it is
    # installed again as it was
    response = case_delete_in_admin(client, tiny.cases.get(key="complete"), path=path)
    services.eval_run_advance(eval_run_id=eval_run.pk)
    suite_install(TINY_SUITE)

    # then the run passed every case it ran, on the suite's hash as it is, but counts for no
    # publish
    assert response.status_code == 302
    eval_run.refresh_from_db()
    assert (eval_run.status, eval_run.suite_changed) == ("completed", True)
    assert eval_run.suite_content_hash == suite_content_hash(tiny)
    with pytest.raises(ReleaseGateFailed):
        skills.skill_version_publish(skill_version=version, actor=dave)


def refusal_shown(response: HttpResponse) -> str:
    """What the admin said instead of deleting: a message on the page it sends the admin back
    to, or the error of the suite's form drawn again."""
    if response.status_code == 302:
        return " ".join(str(message) for message in get_messages(response.wsgi_request))
    return " ".join(response.context["adminform"].form.non_field_errors())


def test_a_case_an_eval_run_has_a_result_of_is_not_deleted_saying_why(demo, dave, tiny, evaluate):
    # given an eval run of tiny that measured both its cases
    eval_run = evaluate(tiny)
    case = tiny.cases.get(key="complete")

    # when a platform admin deletes one of them
    with pytest.raises(ValidationFailed) as refused:
        services.eval_case_delete(case=case, actor=demo.admin)

    # then it is kept, with the result the run counted
    assert str(refused.value) == (
        "tiny/complete is measured in 1 eval run, evidence a release gate may count: the case "
        "is kept."
    )
    assert EvalCase.objects.filter(pk=case.pk).exists()
    assert eval_run.results.filter(case=case).exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", ["page", "selection", "suite page"])
def test_a_case_whose_result_an_eval_run_writes_while_the_admin_deletes_it_is_kept_saying_why(
    client, demo, dave, tiny, monkeypatch, path
):
    # given an eval run of tiny under way, and a platform admin's deletion of its "complete"
    # case that reaches the service only once the eval run, on its own connection, has written
    # the case's result: after the page found nothing that refers to the case
    version = SkillVersion.objects.get(skill__name="weekly-summary", version="3.2.0")
    eval_run, _ = services.eval_run_start(
        actor=dave, suite=tiny, skill_version=version, agent_config=demo.agent
    )
    services.eval_run_advance(eval_run_id=eval_run.pk, seconds=0)
    case = tiny.cases.get(key="complete")
    delete = services.eval_case_delete

    def advance() -> None:
        try:
            services.eval_run_advance(eval_run_id=eval_run.pk)
        finally:
            connection.close()

    runner = threading.Thread(target=advance)

    def delete_once_the_result_is_written(**kwargs) -> None:
        runner.start()
        for _ in range(6000):
            if EvalCaseResult.objects.filter(case=case).exists():
                break
            time.sleep(0.01)
        delete(**kwargs)

    monkeypatch.setattr(services, "eval_case_delete", delete_once_the_result_is_written)
    client.force_login(demo.admin)

    # when the admin deletes the case
    response = case_delete_in_admin(client, case, path=path)
    runner.join(timeout=60)
    queue_purge()

    # then it is kept, the admin is told why, and the eval run counted it
    assert "tiny/complete is measured in 1 eval run" in refusal_shown(response)
    assert EvalCase.objects.filter(pk=case.pk).exists()
    eval_run.refresh_from_db()
    assert (eval_run.status, eval_run.cases_done, eval_run.suite_changed) == (
        "completed",
        2,
        False,
    )
