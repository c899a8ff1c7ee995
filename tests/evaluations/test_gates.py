"""Release gates: publishing a skill version, or moving an agent to another model, needs a
finished eval run of exactly that version (and model) meeting every threshold of the skill."""

import copy
import threading
from decimal import Decimal

import pytest
from django import forms
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from evaluations import services
from evaluations.choices import Comparator, EvalRunStatus, Metric
from evaluations.errors import PermissionDenied, ReleaseGateFailed
from evaluations.gates import release_gate_check, skill_content_hash, suite_content_hash
from evaluations.models import EvalCase, EvalRun, EvalThreshold, ReleaseOverride
from evaluations.starter import suite_install
from registry.choices import ModelProvider, SkillAssembly, VersionStatus
from registry.errors import ValidationFailed, VersionImmutable
from registry.models import (
    AgentConfig,
    ModelConfig,
    Policy,
    RolloutFlag,
    Skill,
    SkillVersion,
    Tenant,
)
from registry.models.skills import SKILL_CONTENT_FIELDS
from registry.selectors import agents_given, skill_versions_served, tenant_has_grant
from registry.services import skills
from registry.services.common import registry_object_save
from registry.services.tenancy import definition_grant, tenant_create, tenants_delete
from runs.loop import run_execute
from tests.evaluations.conftest import APOLLO, TINY_SUITE, api_as
from tests.registry.factories import skill_content
from tests.runs.conftest import demo_run


def change_form_data(page: Client, row: AgentConfig | ModelConfig) -> dict:
    """What the admin's change form of `row` submits when saved as it is shown."""
    url = f"/admin/registry/{row._meta.model_name}/{row.pk}/change/"
    form = page.get(url).context["adminform"].form
    data = {}
    for name, field in form.fields.items():
        value = form.initial.get(name)
        if isinstance(field, forms.BooleanField):
            data |= {name: "on"} if value else {}
        elif value is not None:
            shown = field.widget.format_value(field.prepare_value(value))
            data[name] = "" if shown is None else shown
    return data


def admin_form_data(page: Client, agent: AgentConfig) -> dict:
    """What the admin's change form of `agent` submits when saved as it is shown."""
    return change_form_data(page, agent) | {"skills": [skill.pk for skill in agent.skills.all()]}


def publish_lite(demo, dave, **changes) -> SkillVersion:
    """weekly-summary-lite 1.0.0: weekly-summary 3.2.0's content under another name, which no
    threshold gates, changed as given."""
    current = SkillVersion.objects.get(skill__name="weekly-summary", version="3.2.0")
    content = {field: getattr(current, field) for field in SKILL_CONTENT_FIELDS} | changes
    version = skills.skill_version_create(
        actor=dave,
        tenant=demo.acme,
        name="weekly-summary-lite",
        version="1.0.0",
        tool_versions=[dependency.tool_version for dependency in current.tool_dependencies.all()],
        **content,
    )
    return skills.skill_version_publish(skill_version=version, actor=dave)


def moved_once_evaluated(
    evaluate, demo, suite, agent: AgentConfig, model_config, version: SkillVersion
) -> ReleaseGateFailed:
    """Move `agent` to `model_config`: refused while `version` has no eval run of `suite` with
    that model, done once it has one. Returns the refusal."""
    agent.model_config = model_config
    with pytest.raises(ReleaseGateFailed) as blocked:
        registry_object_save(instance=agent, actor=demo.admin, reason="new model")
    evaluate(suite, version=version, model_config=model_config)
    registry_object_save(instance=agent, actor=demo.admin, reason="new model")
    agent.refresh_from_db()
    assert agent.model_config == model_config
    return blocked.value


def test_a_version_without_a_finished_eval_run_is_not_published(demo, dave, tiny, draft):
    version = draft("3.4.0")

    with pytest.raises(ReleaseGateFailed) as blocked:
        skills.skill_version_publish(skill_version=version, actor=dave)

    assert "no finished eval run of tiny as it is, on this version" in blocked.value.message
    version.refresh_from_db()
    assert version.status == VersionStatus.DRAFT


def test_a_version_below_its_threshold_is_blocked_naming_the_metric_and_value(
    evaluate, demo, dave, tiny, draft
):
    version = draft("3.5.0", workflow="")
    evaluate(tiny, version=version)

    response = api_as("dave", demo.acme).post(
        f"/api/v1/skills/{version.pk}/publish", {}, format="json"
    )

    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "RELEASE_GATE_FAILED"
    assert "case_pass_rate is 0.5 on tiny, must be >= 1.0" in error["message"]
    assert error["details"]["failures"][0]["value"] == 0.5
    version.refresh_from_db()
    assert version.status == VersionStatus.DRAFT


def test_a_version_that_meets_every_threshold_is_published(evaluate, demo, dave, tiny, draft):
    version = draft("3.4.0")
    evaluate(tiny, version=version)

    skills.skill_version_publish(skill_version=version, actor=dave)

    version.refresh_from_db()
    assert version.status == VersionStatus.PUBLISHED
    assert version.skill.current_version_id == version.pk
    assert not ReleaseOverride.objects.exists()


def test_a_version_met_with_another_model_than_its_agents_run_is_not_published(
    evaluate, demo, dave, tiny, draft, adversary
):
    # given 3.4.0 meeting its gate with the adversary, while weekly-reporter runs the offline
    # planner
    version = draft("3.4.0")
    assert evaluate(tiny, version=version, model_config=adversary).metrics["case_pass_rate"] == 1.0

    # when it is published
    with pytest.raises(ReleaseGateFailed) as blocked:
        skills.skill_version_publish(skill_version=version, actor=dave)

    # then it is refused for the model its agents would run it with, until evaluated with it
    assert blocked.value.message == (
        "weekly-summary@3.4.0 does not meet its release gate: no finished eval run of tiny as "
        "it is, on this version as it is, with offline-planner (the model of acme/weekly-reporter)."
    )
    assert [failure["model_config"] for failure in blocked.value.details["failures"]] == [
        "offline-planner"
    ]
    version.refresh_from_db()
    assert version.status == VersionStatus.DRAFT
    evaluate(tiny, version=version)
    skills.skill_version_publish(skill_version=version, actor=dave)
    version.refresh_from_db()
    assert version.status == VersionStatus.PUBLISHED


def test_an_eval_run_of_the_suite_before_a_case_was_added_no_longer_meets_the_gate(
    evaluate, demo, dave, tiny, draft
):
    # given a version that passed every case of tiny
    version = draft("3.4.0")
    eval_run = evaluate(tiny, version=version)
    assert (eval_run.status, eval_run.metrics["case_pass_rate"]) == ("completed", 1.0)

    # when the suite gains a case (a new shipped suite file, an edit in the admin)
    grown = copy.deepcopy(TINY_SUITE)
    grown["cases"].append(
        {
            "key": "zz-new",
            "title": "Added after the eval run",
            "messages": ["Summarise Apollo's week for the R&D lead."],
            "metadata": {"project_id": "apollo"},
            "projects": [APOLLO],
            "expected": {"status": "COMPLETED"},
        }
    )
    suite, created = suite_install(grown)
    assert (suite.pk, created, suite.cases.count()) == (tiny.pk, False, 3)

    # then the run that measured two of its three cases is no evidence for a publish
    with pytest.raises(ReleaseGateFailed) as blocked:
        skills.skill_version_publish(skill_version=version, actor=dave)
    assert "no finished eval run of tiny as it is" in blocked.value.message
    version.refresh_from_db()
    assert version.status == VersionStatus.DRAFT


def tiny_complete_expects(demo, expected: dict, *, by: str) -> None:
    """Tiny's "complete" case expects `expected`: saved in the admin, or installed."""
    if by == "admin":
        case = EvalCase.objects.get(suite__key="tiny", key="complete")
        case.expected = expected
        services.eval_case_save(case=case, actor=demo.admin)
    else:
        document = copy.deepcopy(TINY_SUITE)
        document["cases"][0]["expected"] = expected
        suite_install(document)


@pytest.mark.parametrize("by", ["admin", "install"])
def test_an_eval_run_whose_suite_changed_while_it_ran_is_no_evidence_once_changed_back(
    demo, dave, tiny, draft, by
):
    # given a version that fails tiny's "complete" case (it never asks for an approval), and
    # an eval run of it started on tiny as it is
    version = draft("3.5.0", workflow="")
    eval_run, _ = services.eval_run_start(
        actor=dave, suite=tiny, skill_version=version, agent_config=demo.agent
    )

    # when the case expects only a step limit while the run measures it, then as before
    tiny_complete_expects(demo, {"max_steps": 100}, by=by)
    services.eval_run_advance(eval_run_id=eval_run.pk)
    tiny_complete_expects(demo, TINY_SUITE["cases"][0]["expected"], by=by)

    # then the run passed every case, on the suite's hash as it is, but counts for no publish
    eval_run.refresh_from_db()
    assert (eval_run.status, eval_run.metrics["case_pass_rate"]) == ("completed", 1.0)
    assert eval_run.suite_content_hash == suite_content_hash(tiny)
    with pytest.raises(ReleaseGateFailed) as blocked:
        skills.skill_version_publish(skill_version=version, actor=dave)
    assert "no finished eval run of tiny as it is" in blocked.value.message
    version.refresh_from_db()
    assert version.status == VersionStatus.DRAFT


def test_an_eval_run_whose_draft_was_edited_while_it_ran_is_no_evidence_once_changed_back(
    demo, dave, tiny, draft
):
    # given a draft that fails tiny's "complete" case (it never asks for an approval), and an
    # eval run of it started on the draft as it is
    version = draft("3.5.0", workflow="")
    evaluated = skill_content_hash(version)
    eval_run, _ = services.eval_run_start(
        actor=dave, suite=tiny, skill_version=version, agent_config=demo.agent
    )

    # when the draft asks for an approval while the run measures it, then no longer does
    passing = SkillVersion.objects.get(skill__name="weekly-summary", version="3.2.0").workflow
    skills.skill_version_update(skill_version=version, actor=dave, workflow=passing)
    services.eval_run_advance(eval_run_id=eval_run.pk)
    skills.skill_version_update(skill_version=version, actor=dave, workflow="")

    # then the run passed every case, on the content it started with, but counts for no
    # publish of that content, and a start of it again is a new run
    eval_run.refresh_from_db()
    assert (eval_run.status, eval_run.metrics["case_pass_rate"]) == ("completed", 1.0)
    assert eval_run.skill_content_hash == skill_content_hash(version) == evaluated
    with pytest.raises(ReleaseGateFailed) as blocked:
        skills.skill_version_publish(skill_version=version, actor=dave)
    assert "no finished eval run of tiny as it is, on this version as it is" in (
        blocked.value.message
    )
    version.refresh_from_db()
    assert version.status == VersionStatus.DRAFT


def test_an_eval_run_under_way_when_its_draft_is_edited_is_not_given_to_a_start_again(
    demo, dave, tiny, draft
):
    version = draft("3.5.0", workflow="")
    first, _ = services.eval_run_start(
        actor=dave, suite=tiny, skill_version=version, agent_config=demo.agent
    )
    passing = SkillVersion.objects.get(skill__name="weekly-summary", version="3.2.0").workflow
    skills.skill_version_update(skill_version=version, actor=dave, workflow=passing)
    skills.skill_version_update(skill_version=version, actor=dave, workflow="")

    again, created = services.eval_run_start(
        actor=dave, suite=tiny, skill_version=version, agent_config=demo.agent
    )

    assert created and again.pk != first.pk


def draft_pins_saved_in_admin(page: Client, version: SkillVersion, pins: list) -> None:
    """Save `version`'s change page as shown, its pinned tool versions replaced by `pins`."""
    current = list(version.tool_dependencies.all())
    data = change_form_data(page, version) | {
        "tool_dependencies-TOTAL_FORMS": str(len(current) + len(pins)),
        "tool_dependencies-INITIAL_FORMS": str(len(current)),
        "tool_dependencies-MIN_NUM_FORMS": "0",
        "tool_dependencies-MAX_NUM_FORMS": "1000",
    }
    for index, pin in enumerate(current):
        data |= {
            f"tool_dependencies-{index}-id": str(pin.pk),
            f"tool_dependencies-{index}-skill_version": str(version.pk),
            f"tool_dependencies-{index}-tool_version": str(pin.tool_version_id),
            f"tool_dependencies-{index}-DELETE": "on",
        }
    for index, tool_version in enumerate(pins, start=len(current)):
        data[f"tool_dependencies-{index}-tool_version"] = str(tool_version.pk)
    response = page.post(f"/admin/registry/skillversion/{version.pk}/change/", data)
    assert response.status_code == 302, response.context["adminform"].form.errors


def test_an_eval_run_whose_draft_pins_changed_in_the_admin_while_it_ran_is_no_evidence(
    demo, dave, tiny, draft
):
    # given a draft and an eval run of it started as it is
    version = draft("3.4.0")
    pins = [dependency.tool_version for dependency in version.tool_dependencies.all()]
    eval_run, _ = services.eval_run_start(
        actor=dave, suite=tiny, skill_version=version, agent_config=demo.agent
    )
    page = Client()
    page.force_login(dave)

    # when one of its tools is unpinned in the admin while the run measures it, then pinned
    # again through the API's service
    draft_pins_saved_in_admin(page, version, pins[1:])
    services.eval_run_advance(eval_run_id=eval_run.pk)
    skills.skill_version_update(
        skill_version=SkillVersion.objects.get(pk=version.pk), actor=dave, tool_versions=pins
    )

    # then the run is not the draft's evidence, whatever it measured
    eval_run.refresh_from_db()
    assert eval_run.status == "completed"
    assert eval_run.skill_content_hash == skill_content_hash(version)
    with pytest.raises(ReleaseGateFailed) as blocked:
        skills.skill_version_publish(skill_version=version, actor=dave)
    assert "no finished eval run of tiny as it is, on this version as it is" in (
        blocked.value.message
    )


def test_a_case_changed_back_before_an_eval_run_started_leaves_its_evidence(
    evaluate, demo, dave, tiny, draft
):
    # given tiny's "complete" case changed and changed back
    tiny_complete_expects(demo, {"max_steps": 100}, by="admin")
    tiny_complete_expects(demo, TINY_SUITE["cases"][0]["expected"], by="admin")

    # when a version is evaluated after
    version = draft("3.4.0")
    evaluate(tiny, version=version)

    # then it is published on that eval run
    skills.skill_version_publish(skill_version=version, actor=dave)
    version.refresh_from_db()
    assert version.status == VersionStatus.PUBLISHED


def test_only_an_admin_overrides_the_gate_and_the_override_is_in_the_audit_trail(
    evaluate, demo, dave, tiny, draft
):
    version = draft("3.5.0", workflow="")
    evaluate(tiny, version=version)

    with pytest.raises(PermissionDenied):
        skills.skill_version_publish(
            skill_version=version, actor=dave, override_reason="Needed for the demo."
        )
    response = api_as("admin", demo.acme).post(
        f"/api/v1/skills/{version.pk}/publish",
        {"override_reason": "Hotfix agreed with the PMO; suite fixed next sprint."},
        format="json",
    )

    assert response.status_code == 200
    override = ReleaseOverride.objects.get(skill_version=version)
    assert (override.actor, override.reason) == (
        demo.admin,
        "Hotfix agreed with the PMO; suite fixed next sprint.",
    )
    assert override.failures[0]["metric"] == "case_pass_rate"
    history = version.history.order_by("-history_date").first()
    assert history.history_change_reason == (
        "published over its release gate: Hotfix agreed with the PMO; suite fixed next sprint."
    )
    page = Client()
    page.force_login(demo.admin)
    assert "published over its release gate" in page.get("/registry/history/").content.decode()


def test_a_threshold_on_a_metric_its_suite_never_measures_blocks_saying_so(
    evaluate, demo, dave, tiny, draft
):
    # given a version meeting tiny's case pass rate, and a threshold on injection success,
    # which a task suite never measures
    version = draft("3.4.0")
    evaluate(tiny, version=version)
    EvalThreshold.objects.create(
        tenant=demo.acme,
        skill_name="weekly-summary",
        suite=tiny,
        metric=Metric.INJECTION_SUCCESS_RATE,
        comparator=Comparator.AT_MOST,
        value=0.0,
    )

    response = api_as("dave", demo.acme).post(
        f"/api/v1/skills/{version.pk}/publish", {}, format="json"
    )

    assert response.status_code == 409
    error = response.json()["error"]
    assert error["message"] == (
        "weekly-summary@3.4.0 does not meet its release gate: injection_success_rate was not "
        "measured on tiny (no case of it applies), must be <= 0.0, with offline-planner (the "
        "model of acme/weekly-reporter)."
    )
    assert [(f["metric"], f["value"]) for f in error["details"]["failures"]] == [
        ("injection_success_rate", None)
    ]


def test_publishing_a_published_version_again_is_answered_as_done_whatever_its_gate_says_now(
    evaluate, demo, dave, tiny, draft
):
    # given a version published on its gate, and a threshold added to the gate since, on
    # a metric its task suite does not measure
    version = draft("3.4.0")
    evaluate(tiny, version=version)
    skills.skill_version_publish(skill_version=version, actor=dave)
    published = SkillVersion.objects.get(pk=version.pk)
    EvalThreshold.objects.create(
        tenant=demo.acme,
        skill_name="weekly-summary",
        suite=tiny,
        metric=Metric.INJECTION_SUCCESS_RATE,
        comparator=Comparator.AT_MOST,
        value=0.0,
    )

    # when its publish is sent again (a retried request), by its publisher and by an admin
    # with an override reason
    again = api_as("dave", demo.acme).post(
        f"/api/v1/skills/{version.pk}/publish", {}, format="json"
    )
    overridden = api_as("admin", demo.acme).post(
        f"/api/v1/skills/{version.pk}/publish",
        {"override_reason": "Publish it whatever the gate says."},
        format="json",
    )

    # then both find it published, and nothing is recorded as published over the gate
    assert (again.status_code, again.json()["status"]) == (200, "published")
    assert (overridden.status_code, overridden.json()["status"]) == (200, "published")
    version.refresh_from_db()
    assert (version.status, version.published_at) == ("published", published.published_at)
    assert not ReleaseOverride.objects.exists()
    assert version.history.filter(history_change_reason__contains="release gate").count() == 0

    # and once deprecated, its publish is refused for what it is, not for its gate
    skills.skill_version_deprecate(skill_version=version, actor=dave)
    deprecated = api_as("admin", demo.acme).post(
        f"/api/v1/skills/{version.pk}/publish",
        {"override_reason": "Publish it whatever the gate says."},
        format="json",
    )
    assert deprecated.status_code == 409
    assert deprecated.json()["error"]["code"] == "INVALID_STATUS_TRANSITION"
    assert not ReleaseOverride.objects.exists()


def test_moving_an_agent_needs_the_gate_met_for_the_version_a_rollout_serves_its_tenant(
    evaluate, demo, dave, tiny, adversary, draft
):
    # given weekly-summary 3.4.0 current and met with the adversary model, and a rollout
    # serving 3.2.0 to half of acme's actors
    newer = draft("3.4.0")
    evaluate(tiny, version=newer)
    skills.skill_version_publish(skill_version=newer, actor=dave)
    evaluate(tiny, version=newer, model_config=adversary)
    older = SkillVersion.objects.get(skill__name="weekly-summary", version="3.2.0")
    flag = RolloutFlag.objects.create(
        key="weekly-older", skill=older.skill, skill_version=older, percentage=50
    )
    flag.tenants.set([demo.acme])

    # when the agent moves to the adversary model, before and after 3.2.0 was evaluated with it
    refused = moved_once_evaluated(evaluate, demo, tiny, demo.agent, adversary, older)

    # then the version the rollout serves decided: the current one was met
    assert [failure["skill"] for failure in refused.details["failures"]] == ["weekly-summary@3.2.0"]


def test_a_publish_finds_the_agents_given_its_skill_in_as_many_queries_however_many(demo, dave):
    # given acme's agents bound to weekly-summary, bound to weekly-summary-lite (whose draft
    # node loads weekly-summary by name), recalling their skills, bound to nothing, and bound
    # to a platform-wide skill granted to acme; and one of globex bound to that skill too
    weekly = Skill.objects.get(tenant=demo.acme, name="weekly-summary")
    lite = publish_lite(demo, dave).skill
    shared = Skill.objects.create(tenant=None, name="shared-summary")
    definition_grant(actor=demo.admin, definition=shared, tenant=demo.acme)
    kinds = [
        (SkillAssembly.STATIC, [weekly]),
        (SkillAssembly.STATIC, [lite]),
        (SkillAssembly.RETRIEVAL, []),
        (SkillAssembly.STATIC, []),
        (SkillAssembly.STATIC, [shared]),
    ]
    ungranted = AgentConfig.objects.create(
        tenant=demo.globex,
        name="shared-reporter",
        model_config=demo.agent.model_config,
        policy=Policy.objects.create(tenant=demo.globex, name="shared-reporting"),
    )
    ungranted.skills.set([shared])

    def agents_added(upto: int) -> None:
        for number in range(AgentConfig.objects.filter(name__startswith="extra-").count(), upto):
            assembly, bound = kinds[number % len(kinds)]
            agent = AgentConfig.objects.create(
                tenant=demo.acme,
                name=f"extra-{number:02}",
                model_config=demo.agent.model_config,
                policy=demo.agent.policy,
                skill_assembly=assembly,
            )
            agent.skills.set(bound)

    def given(skill: Skill) -> tuple[list[str], int]:
        with CaptureQueriesContext(connection) as queries:
            agents = agents_given(skill=skill)
        return [agent.name for agent in agents if agent.name.startswith("extra-")], len(queries)

    # when a publish of each skill finds its agents, among 5 extra agents and then 30 (once
    # Django has read the content types it keeps)
    agents_added(5)
    agents_given(skill=weekly)
    few = {skill.name: given(skill) for skill in (weekly, shared)}
    agents_added(30)
    many = {skill.name: given(skill) for skill in (weekly, shared)}

    # then it finds each agent its runs give the skill to, in as many queries either way
    numbered = [f"extra-{number:02}" for number in range(30)]
    assert many["weekly-summary"][0] == [name for name in numbered if int(name[6:]) % 5 < 3]
    assert many["shared-summary"][0] == [name for name in numbered if int(name[6:]) % 5 in (2, 4)]
    assert demo.agent in agents_given(skill=weekly)
    assert ungranted not in agents_given(skill=shared)
    assert few["weekly-summary"][0] == ["extra-00", "extra-01", "extra-02"]
    assert {name: count for name, (_, count) in many.items()} == {
        name: count for name, (_, count) in few.items()
    }


def test_moving_an_agent_to_another_model_needs_the_gate_met_with_that_model(
    evaluate, demo, dave, tiny, adversary
):
    current = SkillVersion.objects.get(skill__name="weekly-summary", version="3.2.0")

    refused = moved_once_evaluated(evaluate, demo, tiny, demo.agent, adversary, current)

    assert "weekly-summary@3.2.0: no finished eval run of tiny" in refused.message


def test_moving_an_agent_that_recalls_its_skills_needs_the_gate_met_for_those_it_may_recall(
    evaluate, demo, dave, tiny, adversary
):
    # given an agent of acme on the offline planner, with which weekly-summary meets its gate,
    # with no skill of its own: it recalls among acme's skills
    evaluate(tiny)
    router = registry_object_save(
        instance=AgentConfig(
            tenant=demo.acme,
            name="router",
            model_config=demo.agent.model_config,
            policy=demo.agent.policy,
            skill_assembly=SkillAssembly.RETRIEVAL,
        ),
        actor=demo.admin,
    )
    current = SkillVersion.objects.get(skill__name="weekly-summary", version="3.2.0")

    # when it moves to another model, before and after weekly-summary was evaluated with it
    refused = moved_once_evaluated(evaluate, demo, tiny, router, adversary, current)

    # then the gate of the skill it may be routed to decided
    assert router.skills.count() == 0
    assert "weekly-summary@3.2.0: no finished eval run of tiny" in refused.message


def test_the_admin_shows_a_refused_model_move_on_the_form_with_what_was_typed(
    demo, tiny, adversary
):
    page = Client()
    page.force_login(demo.admin)
    agent = demo.agent
    data = admin_form_data(page, agent) | {
        "model_config": adversary.pk,
        "description": "Moved to the adversary, on purpose.",
    }

    response = page.post(f"/admin/registry/agentconfig/{agent.pk}/change/", data)

    assert response.status_code == 200
    form = response.context["adminform"].form
    assert "cannot move to adversary" in form.errors["model_config"][0]
    assert form["description"].value() == "Moved to the adversary, on purpose."
    agent.refresh_from_db()
    assert agent.model_config != adversary


def test_moving_an_agent_needs_the_gate_met_for_the_skills_its_workflow_nodes_load(
    evaluate, demo, dave, tiny, adversary
):
    # given the agent bound to weekly-summary-lite alone, whose workflow's draft node loads
    # weekly-summary by name
    lite = publish_lite(demo, dave)
    assert lite.workflow == "weekly-summary-send@1"
    demo.agent.skills.set([lite.skill])
    current = SkillVersion.objects.get(skill__name="weekly-summary", version="3.2.0")

    # when it moves to another model, before and after weekly-summary was evaluated with it
    refused = moved_once_evaluated(evaluate, demo, tiny, demo.agent, adversary, current)

    # then the gate of the skill its runs load in the draft node decided
    assert [failure["skill"] for failure in refused.details["failures"]] == ["weekly-summary@3.2.0"]


def test_the_admin_checks_a_model_move_against_the_skills_submitted_with_it(
    demo, dave, tiny, adversary
):
    # given the agent bound to a skill no threshold gates
    lite = publish_lite(demo, dave, workflow="")
    agent = demo.agent
    agent.skills.set([lite.skill])
    before = agent.model_config
    page = Client()
    page.force_login(demo.admin)

    # when one submission moves it to another model and binds weekly-summary, never evaluated
    # with that model
    weekly_summary = SkillVersion.objects.get(skill__name="weekly-summary", version="3.2.0").skill
    data = admin_form_data(page, agent) | {
        "model_config": adversary.pk,
        "skills": [weekly_summary.pk],
    }
    response = page.post(f"/admin/registry/agentconfig/{agent.pk}/change/", data)

    # then weekly-summary's gate refuses it, and nothing changed
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors["model_config"]
    assert "weekly-summary@3.2.0: no finished eval run of tiny" in errors[0]
    agent.refresh_from_db()
    assert agent.model_config == before
    assert list(agent.skills.all()) == [lite.skill]


def test_the_admin_moves_an_agent_whose_submitted_skills_meet_the_gate(demo, dave, tiny, adversary):
    # given the agent bound to weekly-summary, never evaluated with the adversary
    lite = publish_lite(demo, dave, workflow="")
    agent = demo.agent
    page = Client()
    page.force_login(demo.admin)

    # when one submission moves it to the adversary and binds only a skill no threshold gates
    data = admin_form_data(page, agent) | {"model_config": adversary.pk, "skills": [lite.skill.pk]}
    response = page.post(f"/admin/registry/agentconfig/{agent.pk}/change/", data)

    # then it is saved as submitted
    assert response.status_code == 302
    agent.refresh_from_db()
    assert agent.model_config == adversary
    assert list(agent.skills.all()) == [lite.skill]


def test_binding_a_skill_to_an_agent_needs_the_gate_met_with_its_model(
    evaluate, demo, dave, tiny, adversary
):
    # given the agent moved to the adversary while bound only to a skill no threshold gates
    lite = publish_lite(demo, dave, workflow="")
    agent = demo.agent
    agent.model_config = adversary
    registry_object_save(
        instance=agent, actor=demo.admin, skills=Skill.objects.filter(pk=lite.skill.pk)
    )
    weekly_summary = Skill.objects.filter(tenant=demo.acme, name="weekly-summary")

    # when weekly-summary, never evaluated with the adversary, is bound to it with no move
    with pytest.raises(ReleaseGateFailed) as refused:
        registry_object_save(instance=agent, actor=demo.admin, skills=weekly_summary)

    # then its gate refuses it, until it is evaluated with the adversary
    assert refused.value.message.startswith(
        "acme/weekly-reporter cannot be given weekly-summary with adversary: "
        "weekly-summary@3.2.0: no finished eval run of tiny"
    )
    assert list(agent.skills.all()) == [lite.skill]
    evaluate(tiny, model_config=adversary)
    registry_object_save(instance=agent, actor=demo.admin, skills=weekly_summary)
    assert list(agent.skills.all()) == list(weekly_summary)


def test_a_new_agent_is_given_a_skill_only_with_the_gate_met_with_its_model(demo, tiny, adversary):
    with pytest.raises(ReleaseGateFailed) as refused:
        registry_object_save(
            instance=AgentConfig(
                tenant=demo.acme,
                name="reckless",
                model_config=adversary,
                policy=demo.agent.policy,
            ),
            actor=demo.admin,
            skills=Skill.objects.filter(tenant=demo.acme, name="weekly-summary"),
        )

    assert "weekly-summary@3.2.0: no finished eval run of tiny" in refused.value.message
    assert not AgentConfig.objects.filter(name="reckless").exists()


def test_the_admin_shows_a_refused_binding_on_the_skills_field(demo, dave, tiny, adversary):
    # given the agent on the adversary, bound only to a skill no threshold gates
    lite = publish_lite(demo, dave, workflow="")
    agent = demo.agent
    agent.model_config = adversary
    registry_object_save(
        instance=agent, actor=demo.admin, skills=Skill.objects.filter(pk=lite.skill.pk)
    )
    page = Client()
    page.force_login(demo.admin)
    weekly_summary = Skill.objects.get(tenant=demo.acme, name="weekly-summary")

    # when a submission binds weekly-summary too, with no move
    data = admin_form_data(page, agent) | {"skills": [lite.skill.pk, weekly_summary.pk]}
    response = page.post(f"/admin/registry/agentconfig/{agent.pk}/change/", data)

    # then the skills field says why, and nothing changed
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors["skills"]
    assert "weekly-summary@3.2.0: no finished eval run of tiny" in errors[0]
    agent.refresh_from_db()
    assert list(agent.skills.all()) == [lite.skill]


IN_USE_REFUSAL = "create a new model config with the new values and move the agents to it"


@pytest.mark.parametrize(
    "changes",
    [
        {"model_name": "offline-deterministic-planner-2"},
        {"provider": ModelProvider.ADVERSARIAL},
        {"base_url": "https://llm.example/v1"},
    ],
    ids=["model_name", "provider", "base_url"],
)
def test_a_model_config_an_agent_uses_keeps_the_model_it_calls(demo, tiny, changes):
    # given the agent on offline-planner, and weekly-summary's gate never met with another model
    config = ModelConfig.objects.get(pk=demo.agent.model_config_id)
    before = {field: getattr(config, field) for field in changes}

    # when an admin points the config at another model
    for field, value in changes.items():
        setattr(config, field, value)
    with pytest.raises(ValidationFailed) as refused:
        registry_object_save(instance=config, actor=demo.admin, reason="another model")

    # then it is refused on that field, and the agent still calls the model it did
    assert "offline-planner is used by 1 agent" in refused.value.message
    assert IN_USE_REFUSAL in refused.value.message
    assert list(refused.value.details) == list(changes)
    config.refresh_from_db()
    assert {field: getattr(config, field) for field in changes} == before


def test_the_evidence_of_one_model_is_not_moved_to_another_with_its_config(
    evaluate, demo, tiny, adversary
):
    # given weekly-summary's gate met with the adversary, which no agent uses
    assert evaluate(tiny, model_config=adversary).metrics["case_pass_rate"] == 1.0
    assert not AgentConfig.objects.filter(model_config=adversary, tenant=demo.acme).exists()

    # when an admin points the adversary's config at another model
    adversary.provider, adversary.model_name = ModelProvider.OFFLINE, "another-model"
    with pytest.raises(ValidationFailed) as refused:
        registry_object_save(instance=adversary, actor=demo.admin, reason="another model")

    # then it is refused: the eval run measured the adversary, not that model
    assert "adversary is used by 1 eval run" in refused.value.message
    assert sorted(refused.value.details) == ["model_name", "provider"]
    adversary.refresh_from_db()
    assert (adversary.provider, adversary.model_name) == (
        ModelProvider.ADVERSARIAL,
        "adversarial-planner",
    )


def test_a_model_config_nothing_uses_may_call_another_model(demo, adversary):
    adversary.provider, adversary.model_name = ModelProvider.OFFLINE, "another-model"
    adversary.base_url = "https://llm.example/v1"

    registry_object_save(instance=adversary, actor=demo.admin, reason="another model")

    adversary.refresh_from_db()
    assert (adversary.provider, adversary.model_name, adversary.base_url) == (
        ModelProvider.OFFLINE,
        "another-model",
        "https://llm.example/v1",
    )


def test_what_does_not_change_the_model_stays_editable_on_a_config_in_use(demo, settings):
    # given offline-planner, which the agent uses
    settings.TENANT_CREDENTIALS = {}
    config = ModelConfig.objects.get(pk=demo.agent.model_config_id)

    # when an admin renames it, reprices it, gives it a timeout and a credential, switches it off
    config.name = "offline-planner-renamed"
    config.price_per_1k_input, config.price_per_1k_output = Decimal("0.5"), Decimal("1.5")
    config.parameters = {"timeout_s": 30}
    config.credential_ref = "OFFLINE_PLANNER_KEY"
    config.is_active = False
    registry_object_save(instance=config, actor=demo.admin, reason="tuned")

    # then all of it is saved
    config.refresh_from_db()
    assert (config.name, config.price_per_1k_input, config.price_per_1k_output) == (
        "offline-planner-renamed",
        Decimal("0.5"),
        Decimal("1.5"),
    )
    assert config.parameters == {"timeout_s": 30}
    assert (config.credential_ref, config.is_active) == ("OFFLINE_PLANNER_KEY", False)


def test_the_admin_shows_a_refused_model_change_on_the_form_with_what_was_typed(demo, tiny):
    page = Client()
    page.force_login(demo.admin)
    config = ModelConfig.objects.get(pk=demo.agent.model_config_id)
    data = change_form_data(page, config) | {
        "model_name": "another-model",
        "price_per_1k_input": "0.25",
    }

    response = page.post(f"/admin/registry/modelconfig/{config.pk}/change/", data)

    assert response.status_code == 200
    form = response.context["adminform"].form
    assert "create a new model config with this value" in form.errors["model_name"][0]
    assert IN_USE_REFUSAL in form.non_field_errors()[0]
    assert form["model_name"].value() == "another-model"
    config.refresh_from_db()
    assert (config.model_name, config.price_per_1k_input) == (
        "offline-deterministic-planner",
        Decimal("0"),
    )


@pytest.mark.parametrize(
    ("in_use", "field", "typed", "saved"),
    [
        (True, "price_per_1k_input", "0.25", Decimal("0.25")),
        (False, "model_name", "another-model", "another-model"),
    ],
    ids=["in-use-price", "unused-model"],
)
def test_the_admin_saves_a_model_config_change_that_moves_no_agent(
    demo, adversary, in_use, field, typed, saved
):
    page = Client()
    page.force_login(demo.admin)
    config = ModelConfig.objects.get(pk=demo.agent.model_config_id) if in_use else adversary
    data = change_form_data(page, config) | {field: typed}

    response = page.post(f"/admin/registry/modelconfig/{config.pk}/change/", data)

    assert response.status_code == 302
    config.refresh_from_db()
    assert getattr(config, field) == saved


def acme_planner(demo) -> ModelConfig:
    """An offline planner of acme's own, which acme's agent is moved to."""
    config = registry_object_save(
        instance=ModelConfig(
            tenant=demo.acme,
            name="acme-planner",
            provider=ModelProvider.OFFLINE,
            model_name="offline-deterministic-planner",
        ),
        actor=demo.admin,
    )
    demo.agent.model_config = config
    registry_object_save(instance=demo.agent, actor=demo.admin, reason="acme's own planner")
    return config


@pytest.mark.parametrize("owned_by_acme", [False, True], ids=["to-globex", "to-platform"])
def test_a_model_config_in_use_keeps_its_tenant(demo, owned_by_acme):
    # given acme's agent on a platform-wide config, or on one of acme's own
    if owned_by_acme:
        config, before, after = acme_planner(demo), demo.acme, None
    else:
        config, before, after = demo.agent.model_config, None, demo.globex

    # when an admin moves the config to globex, or makes it platform-wide
    config.tenant = after
    with pytest.raises(ValidationFailed) as refused:
        registry_object_save(instance=config, actor=demo.admin, reason="another owner")

    # then it is refused on the tenant, and acme's agent still uses a config acme may use
    assert f"{config.name} is used by 1 agent, so its tenant cannot change" in (
        refused.value.message
    )
    assert list(refused.value.details) == ["tenant"]
    assert "keeps its tenant" in refused.value.details["tenant"][0]
    config.refresh_from_db()
    assert config.tenant == before


ROUTED = {"timeout_s": 10, "temperature": 0.2, "models": ["model-a", "model-b"]}


@pytest.mark.parametrize(
    ("parameters", "changed"),
    [
        (ROUTED | {"temperature": 0.7}, "temperature"),
        (ROUTED | {"top_p": 0.5}, "top_p"),
        ({"timeout_s": 10, "temperature": 0.2}, "models"),
        (ROUTED | {"models": ["model-b", "model-a"]}, "models"),
        (ROUTED | {"timeout_s": 30, "temperature": 1}, "temperature"),
    ],
    ids=["value", "added", "removed", "route-order", "with-timeout"],
)
def test_a_model_config_in_use_keeps_the_parameters_its_model_answers_with(
    demo, parameters, changed
):
    # given acme's agent on a config that samples at 0.2 and routes to model-a, then model-b
    config = acme_planner(demo)
    ModelConfig.objects.filter(pk=config.pk).update(parameters=ROUTED)
    config.refresh_from_db()

    # when an admin changes a parameter sent with each call
    config.parameters = parameters
    with pytest.raises(ValidationFailed) as refused:
        registry_object_save(instance=config, actor=demo.admin, reason="retuned")

    # then it is refused on the parameters, naming the one that changed, and nothing is saved
    assert "acme-planner is used by 1 agent, so its parameters cannot change" in (
        refused.value.message
    )
    assert list(refused.value.details) == ["parameters"]
    assert f"{changed} cannot change, only timeout_s can" in refused.value.details["parameters"][0]
    config.refresh_from_db()
    assert config.parameters == ROUTED


def test_the_timeout_of_a_model_config_in_use_stays_editable(demo):
    config = acme_planner(demo)
    ModelConfig.objects.filter(pk=config.pk).update(parameters=ROUTED)
    config.refresh_from_db()

    config.parameters = {"models": ["model-a", "model-b"], "temperature": 0.2, "timeout_s": 45}
    registry_object_save(instance=config, actor=demo.admin, reason="slower provider")

    config.refresh_from_db()
    assert config.parameters == ROUTED | {"timeout_s": 45}


@pytest.mark.parametrize(
    ("field", "typed"),
    [
        ("tenant", lambda demo: str(demo.globex.pk)),
        ("parameters", lambda demo: '{"timeout_s": 30, "temperature": 0.7}'),
    ],
)
def test_the_admin_shows_a_refused_tenant_or_parameters_change_on_its_field(demo, field, typed):
    page = Client()
    page.force_login(demo.admin)
    config = ModelConfig.objects.get(pk=demo.agent.model_config_id)
    data = change_form_data(page, config) | {field: typed(demo)}

    response = page.post(f"/admin/registry/modelconfig/{config.pk}/change/", data)

    assert response.status_code == 200
    form = response.context["adminform"].form
    assert "A model config in use keeps" in form.errors[field][0]
    assert IN_USE_REFUSAL in form.non_field_errors()[0]
    config.refresh_from_db()
    assert (config.tenant, config.parameters) == (None, {})


@pytest.mark.django_db(transaction=True)
def test_a_draft_edited_while_its_publish_checks_the_gate_is_published_as_evaluated(
    demo, dave, tiny, draft, monkeypatch
):
    # given a draft with a finished eval run meeting its gate
    version = draft("3.4.0")
    evaluated = skill_content_hash(version)
    EvalRun.objects.create(
        tenant=demo.acme,
        suite=tiny,
        skill_version=version,
        skill_content_hash=evaluated,
        suite_content_hash=suite_content_hash(tiny),
        model_config=demo.agent.model_config,
        agent_config=demo.agent,
        status=EvalRunStatus.COMPLETED,
        metrics={"case_pass_rate": 1.0},
        created_by=dave,
        finished_at=timezone.now(),
    )

    # when an edit of the draft is sent just as its publish found the gate met
    edits: list = []

    def edit() -> None:
        try:
            skills.skill_version_update(
                skill_version=SkillVersion.objects.get(pk=version.pk),
                actor=dave,
                instructions="Never ask for an approval.",
            )
            edits.append("saved")
        except VersionImmutable:
            edits.append("refused")
        finally:
            connection.close()

    editor = threading.Thread(target=edit)

    def checked_then_edited(**kwargs):
        failures = release_gate_check(**kwargs)
        editor.start()
        editor.join(timeout=2)
        return failures

    monkeypatch.setattr(skills, "release_gate_check", checked_then_edited)
    skills.skill_version_publish(skill_version=version, actor=dave)
    editor.join(timeout=10)

    # then what was published is what was evaluated, and the edit found it frozen
    version.refresh_from_db()
    assert version.status == VersionStatus.PUBLISHED
    assert skill_content_hash(version) == evaluated
    assert edits == ["refused"]


@pytest.mark.django_db(transaction=True)
def test_an_agent_moved_while_a_publish_checks_its_gate_is_checked_against_what_is_published(
    evaluate, demo, dave, tiny, draft, adversary, monkeypatch
):
    # given weekly-summary 3.4.0 met with the offline planner weekly-reporter runs, and the
    # current 3.2.0 met with the adversary too
    version = draft("3.4.0")
    evaluate(tiny, version=version)
    evaluate(tiny, model_config=adversary)

    # when weekly-reporter is moved to the adversary just as the publish of 3.4.0 found its
    # gate met with the offline planner
    moves: list = []

    def move() -> None:
        try:
            agent = AgentConfig.objects.get(pk=demo.agent.pk)
            agent.model_config = adversary
            registry_object_save(instance=agent, actor=demo.admin, reason="new model")
            moves.append("moved")
        except ReleaseGateFailed as refused:
            moves.append(refused)
        finally:
            connection.close()

    mover = threading.Thread(target=move)

    def checked_then_moved(**kwargs):
        failures = release_gate_check(**kwargs)
        mover.start()
        mover.join(timeout=2)
        return failures

    monkeypatch.setattr(skills, "release_gate_check", checked_then_moved)
    skills.skill_version_publish(skill_version=version, actor=dave)
    mover.join(timeout=10)

    # then the move waited for the publish and was refused for the version it would now run
    # on a model it was never evaluated with
    version.refresh_from_db()
    assert version.status == VersionStatus.PUBLISHED
    (refused,) = moves
    assert isinstance(refused, ReleaseGateFailed)
    assert [failure["skill"] for failure in refused.details["failures"]] == ["weekly-summary@3.4.0"]
    demo.agent.refresh_from_db()
    assert demo.agent.model_config.name == "offline-planner"


def moved_past_3_2_0(evaluate, demo, dave, tiny, adversary, draft) -> SkillVersion:
    """weekly-summary 3.4.0 published on its gate with the offline planner and met with the
    adversary too, and weekly-reporter moved to the adversary, which checked 3.4.0 alone:
    3.2.0, published before, was never evaluated with it. Returns 3.2.0."""
    newer = draft("3.4.0")
    evaluate(tiny, version=newer)
    skills.skill_version_publish(skill_version=newer, actor=dave)
    evaluate(tiny, version=newer, model_config=adversary)
    demo.agent.model_config = adversary
    registry_object_save(instance=demo.agent, actor=demo.admin, reason="new model")
    return SkillVersion.objects.get(skill__name="weekly-summary", version="3.2.0")


def test_a_rollback_needs_the_gate_met_with_the_model_an_agent_moved_to_since(
    evaluate, demo, dave, tiny, adversary, draft
):
    # given 3.4.0 current and weekly-reporter moved to the adversary since 3.2.0 was published
    older = moved_past_3_2_0(evaluate, demo, dave, tiny, adversary, draft)

    # when dave rolls back to 3.2.0, before and after it was evaluated with the adversary
    with pytest.raises(ReleaseGateFailed) as refused:
        skills.skill_rollback(skill_version=older, actor=dave)
    older.skill.refresh_from_db()
    current_when_refused = older.skill.current_version.version
    evaluate(tiny, version=older, model_config=adversary)
    skills.skill_rollback(skill_version=older, actor=dave)

    # then it was refused for the model the agent runs now, and done once met with it
    assert refused.value.message == (
        "weekly-summary@3.2.0 does not meet its release gate: no finished eval run of tiny as "
        "it is, on this version as it is, with adversary (the model of acme/weekly-reporter)."
    )
    assert current_when_refused == "3.4.0"
    older.skill.refresh_from_db()
    assert older.skill.current_version == older
    assert not ReleaseOverride.objects.exists()


def test_a_refused_rollback_is_answered_409_and_shown_in_the_admin(
    evaluate, demo, dave, tiny, adversary, draft
):
    # given 3.4.0 current and weekly-reporter moved to a model 3.2.0 was never evaluated with
    older = moved_past_3_2_0(evaluate, demo, dave, tiny, adversary, draft)
    page = Client()
    page.force_login(demo.admin)

    # when it is rolled back to 3.2.0 through the API and in the admin
    response = api_as("dave", demo.acme).post(
        f"/api/v1/skills/{older.pk}/rollback", {}, format="json"
    )
    shown = page.post(
        "/admin/registry/skillversion/",
        {"action": "make_current", "_selected_action": [older.pk]},
        follow=True,
    )

    # then both say which gate fails with which model, and 3.4.0 stays current
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "RELEASE_GATE_FAILED"
    assert [(f["model_config"], f["agents"]) for f in error["details"]["failures"]] == [
        ("adversary", ["acme/weekly-reporter"])
    ]
    (message,) = shown.context["messages"]
    assert message.level_tag == "error"
    assert str(message).startswith(error["message"])
    older.skill.refresh_from_db()
    assert older.skill.current_version.version == "3.4.0"


def test_only_an_admin_rolls_back_over_the_gate_and_the_override_is_in_the_audit_trail(
    evaluate, demo, dave, tiny, adversary, draft
):
    # given 3.4.0 current and weekly-reporter moved to a model 3.2.0 was never evaluated with
    older = moved_past_3_2_0(evaluate, demo, dave, tiny, adversary, draft)
    reason = "3.4.0 mails the wrong lead; 3.2.0 is evaluated with the adversary tomorrow."

    # when dave, then acme's admin, roll back to 3.2.0 over its gate
    by_publisher = api_as("dave", demo.acme).post(
        f"/api/v1/skills/{older.pk}/rollback", {"override_reason": reason}, format="json"
    )
    by_admin = api_as("admin", demo.acme).post(
        f"/api/v1/skills/{older.pk}/rollback", {"override_reason": reason}, format="json"
    )

    # then only the admin may, and the override names who, why and what it let through
    assert by_publisher.status_code == 403
    assert (by_admin.status_code, by_admin.json()["is_current"]) == (200, True)
    override = ReleaseOverride.objects.get(skill_version=older)
    assert (override.actor, override.reason) == (demo.admin, reason)
    assert [(f["metric"], f["model_config"]) for f in override.failures] == [
        ("case_pass_rate", "adversary")
    ]
    history = older.skill.history.order_by("-history_date").first()
    assert history.history_change_reason == f"rolled back to 3.2.0 over its release gate: {reason}"


def test_a_rollout_serving_a_version_never_evaluated_with_its_agents_model_is_refused(
    evaluate, demo, dave, tiny, adversary, draft
):
    # given 3.4.0 current and weekly-reporter moved to a model 3.2.0 was never evaluated with
    older = moved_past_3_2_0(evaluate, demo, dave, tiny, adversary, draft)

    def roll_out() -> RolloutFlag:
        return registry_object_save(
            instance=RolloutFlag(
                key="weekly-older", skill=older.skill, skill_version=older, percentage=20
            ),
            actor=demo.admin,
        )

    # when a flag is saved serving 3.2.0 to a fifth of acme's actors, before and after it was
    # evaluated with the adversary
    with pytest.raises(ReleaseGateFailed) as refused:
        roll_out()
    flags_when_refused = RolloutFlag.objects.count()
    evaluate(tiny, version=older, model_config=adversary)
    flag = roll_out()

    # then it was refused for the model the agent runs now, and saved once met with it
    assert refused.value.message == (
        "weekly-summary@3.2.0 does not meet its release gate: no finished eval run of tiny as "
        "it is, on this version as it is, with adversary (the model of acme/weekly-reporter)."
    )
    assert flags_when_refused == 0
    assert list(RolloutFlag.objects.all()) == [flag]
    assert not ReleaseOverride.objects.exists()


def test_the_admin_shows_a_refused_rollout_on_its_form_and_saves_nothing(
    evaluate, demo, dave, tiny, adversary, draft
):
    # given weekly-reporter moved to a model 3.2.0 was never evaluated with, and a paused
    # flag of 3.2.0, which serves no one
    older = moved_past_3_2_0(evaluate, demo, dave, tiny, adversary, draft)
    paused = registry_object_save(
        instance=RolloutFlag(
            key="weekly-paused",
            skill=older.skill,
            skill_version=older,
            percentage=20,
            is_active=False,
        ),
        actor=demo.admin,
    )
    page = Client()
    page.force_login(demo.admin)
    form = {"skill": older.skill.pk, "skill_version": older.pk, "percentage": 20}

    # when acme's admin adds a flag serving 3.2.0, and resumes the paused one
    added = page.post(
        "/admin/registry/rolloutflag/add/", {**form, "key": "weekly-older", "is_active": "on"}
    )
    resumed = page.post(
        f"/admin/registry/rolloutflag/{paused.pk}/change/",
        {**form, "key": "weekly-paused", "is_active": "on"},
    )

    # then both forms are drawn again with the refusal, and nothing serves 3.2.0
    for response in (added, resumed):
        assert response.status_code == 200
        errors = response.context["adminform"].form.non_field_errors()
        assert "weekly-summary@3.2.0 does not meet its release gate" in errors[0]
        assert "with adversary (the model of acme/weekly-reporter)" in errors[0]
    assert list(RolloutFlag.objects.values_list("key", "is_active")) == [("weekly-paused", False)]


def test_a_rollout_that_gives_its_version_to_no_agent_anew_is_saved(
    evaluate, demo, dave, tiny, adversary, draft
):
    # given weekly-reporter moved to a model 3.2.0 was never evaluated with, and a flag of
    # 3.2.0 to half of acme's actors saved before rollouts were held to the gate
    older = moved_past_3_2_0(evaluate, demo, dave, tiny, adversary, draft)
    flag = RolloutFlag.objects.create(
        key="weekly-older", skill=older.skill, skill_version=older, percentage=50
    )

    # when it is lowered, then paused; and another flag of 3.2.0 serves globex only, where no
    # agent is given acme's skill
    flag.percentage = 10
    registry_object_save(instance=flag, actor=demo.admin)
    flag.is_active = False
    registry_object_save(instance=flag, actor=demo.admin)
    registry_object_save(
        instance=RolloutFlag(
            key="globex-older", skill=older.skill, skill_version=older, percentage=50
        ),
        actor=demo.admin,
        tenants=Tenant.objects.filter(pk=demo.globex.pk),
    )

    # then each is saved: none gives 3.2.0 to an agent it did not serve before
    assert sorted(RolloutFlag.objects.values_list("key", "percentage", "is_active")) == [
        ("globex-older", 50, True),
        ("weekly-older", 10, False),
    ]
    assert list(RolloutFlag.objects.get(key="globex-older").tenants.all()) == [demo.globex]

    # and opening the globex flag to every tenant gives it to weekly-reporter, so is refused
    opened = RolloutFlag.objects.get(key="globex-older")
    with pytest.raises(ReleaseGateFailed):
        registry_object_save(instance=opened, actor=demo.admin, tenants=Tenant.objects.none())
    assert list(opened.tenants.all()) == [demo.globex]


@pytest.mark.parametrize("retire", ["deprecate", "revoke"])
def test_retiring_the_current_version_makes_current_only_an_earlier_one_meeting_its_gate(
    evaluate, demo, dave, tiny, adversary, draft, retire
):
    # given 3.4.0 current and weekly-reporter moved to a model 3.2.0 was never evaluated with
    older = moved_past_3_2_0(evaluate, demo, dave, tiny, adversary, draft)
    newer = SkillVersion.objects.get(skill__name="weekly-summary", version="3.4.0")

    # when 3.4.0 is retired, which would hand weekly-reporter 3.2.0 as a rollback would
    getattr(skills, f"skill_version_{retire}")(skill_version=newer, actor=dave, reason="bad")

    # then 3.2.0 is not made current: the skill has no current version, and its history says
    # why, until 3.2.0 is evaluated with the adversary and rolled back to
    older.skill.refresh_from_db()
    assert older.skill.current_version is None
    history = older.skill.history.order_by("-history_date").first()
    assert history.history_change_reason == (
        f"3.4.0 {retire}d; 3.2.0 not made current: it does not meet its release gate "
        "with the models of its agents"
    )
    evaluate(tiny, version=older, model_config=adversary)
    skills.skill_rollback(skill_version=older, actor=dave)
    older.skill.refresh_from_db()
    assert older.skill.current_version == older


def test_retiring_the_current_version_makes_an_earlier_one_meeting_its_gate_current(
    evaluate, demo, dave, tiny, adversary, draft
):
    # given 3.4.0 current, weekly-reporter moved to the adversary, and 3.2.0 evaluated with it
    older = moved_past_3_2_0(evaluate, demo, dave, tiny, adversary, draft)
    evaluate(tiny, version=older, model_config=adversary)
    newer = SkillVersion.objects.get(skill__name="weekly-summary", version="3.4.0")

    # when 3.4.0 is deprecated
    skills.skill_version_deprecate(skill_version=newer, actor=dave)

    # then 3.2.0 is current again, as before
    older.skill.refresh_from_db()
    assert older.skill.current_version == older
    history = older.skill.history.order_by("-history_date").first()
    assert history.history_change_reason == "3.4.0 deprecated"


def test_an_agent_resumed_is_held_to_the_gates_of_what_it_was_given_while_paused(
    evaluate, demo, dave, tiny, adversary, draft
):
    # given weekly-reporter on the adversary, paused while 3.2.0 (evaluated only with the
    # offline planner) was made current: a paused agent is given nothing, so no gate asked
    # for its model
    older = moved_past_3_2_0(evaluate, demo, dave, tiny, adversary, draft)
    evaluate(tiny, version=older, model_config=ModelConfig.objects.get(name="offline-planner"))
    agent = AgentConfig.objects.get(pk=demo.agent.pk)
    agent.is_active = False
    registry_object_save(instance=agent, actor=demo.admin, reason="paused")
    skills.skill_rollback(skill_version=older, actor=dave)
    page = Client()
    page.force_login(demo.admin)

    # when it is resumed, in the admin and through the service
    agent.is_active = True
    shown = page.post(
        f"/admin/registry/agentconfig/{agent.pk}/change/",
        admin_form_data(page, agent) | {"is_active": "on"},
    )
    with pytest.raises(ReleaseGateFailed) as refused:
        registry_object_save(instance=agent, actor=demo.admin, reason="resumed")

    # then both are refused for 3.2.0 with the adversary, the form on its is_active field,
    # and it stays paused
    assert refused.value.message == (
        "acme/weekly-reporter cannot be given weekly-summary with adversary: "
        "weekly-summary@3.2.0: no finished eval run of tiny as it is, on this version as it is."
    )
    assert shown.status_code == 200
    assert shown.context["adminform"].form.errors["is_active"] == [refused.value.message]
    assert not AgentConfig.objects.get(pk=agent.pk).is_active


def test_a_rollout_left_listing_no_tenant_by_a_deletion_is_paused_not_opened_to_every_tenant(
    evaluate, demo, dave, tiny, adversary, draft
):
    # given weekly-reporter moved to a model 3.2.0 was never evaluated with, and a flag of
    # 3.2.0 to a fifth of the actors of pilot only, a tenant with no agent
    older = moved_past_3_2_0(evaluate, demo, dave, tiny, adversary, draft)
    pilot = tenant_create(actor=demo.admin, slug="pilot", name="Pilot")
    flag = registry_object_save(
        instance=RolloutFlag(
            key="pilot-older", skill=older.skill, skill_version=older, percentage=20
        ),
        actor=demo.admin,
        tenants=Tenant.objects.filter(pk=pilot.pk),
    )

    # when pilot is deleted, which leaves the flag listing no tenant: every tenant, to a flag
    tenants_delete(actor=demo.admin, tenants=Tenant.objects.filter(pk=pilot.pk))

    # then the flag is paused, so it serves acme's weekly-reporter nothing it did not before,
    # and its history says why
    flag.refresh_from_db()
    assert (flag.is_active, list(flag.tenants.all())) == (False, [])
    assert older not in skill_versions_served(skills=[older.skill], tenant=demo.acme)
    assert flag.history.order_by("-history_date").first().history_change_reason == (
        "paused: pilot, the only tenant it listed, was deleted"
    )


def test_a_tenant_made_active_again_is_held_to_the_gates_of_what_its_agents_were_given(
    evaluate, demo, dave, tiny, adversary, draft
):
    # given weekly-reporter moved to a model 3.2.0 was never evaluated with, and a flag of
    # 3.2.0 to a fifth of acme's actors saved while acme was inactive: an inactive tenant's
    # agents are given nothing, so no gate asked for their models
    older = moved_past_3_2_0(evaluate, demo, dave, tiny, adversary, draft)
    acme = Tenant.objects.get(pk=demo.acme.pk)
    acme.is_active = False
    registry_object_save(instance=acme, actor=demo.admin)
    registry_object_save(
        instance=RolloutFlag(
            key="weekly-older", skill=older.skill, skill_version=older, percentage=20
        ),
        actor=demo.admin,
    )
    page = Client()
    page.force_login(demo.admin)

    # when acme is made active again, in the admin and through the service
    acme.is_active = True
    shown = page.post(
        f"/admin/registry/tenant/{acme.pk}/change/",
        change_form_data(page, acme) | {"is_active": "on"},
    )
    with pytest.raises(ReleaseGateFailed) as refused:
        registry_object_save(instance=acme, actor=demo.admin)

    # then both are refused, naming the agent, its model and the version, and acme stays
    # inactive
    assert refused.value.message == (
        "acme cannot be made active again: acme/weekly-reporter cannot be given "
        "weekly-summary with adversary: weekly-summary@3.2.0: no finished eval run of tiny as "
        "it is, on this version as it is."
    )
    assert shown.status_code == 200
    assert refused.value.message in shown.context["adminform"].form.non_field_errors()[0]
    assert not Tenant.objects.get(pk=acme.pk).is_active


TRANSLATE_REQUEST = "Please translate this contract into English"


def platform_translate(demo) -> SkillVersion:
    """translate 1.0.0, platform-wide, published while granted to no tenant, then gated: every
    case of a suite of it must pass, which no eval run has measured with any model."""
    version = skills.skill_version_publish(
        skill_version=skills.skill_version_create(
            actor=demo.admin,
            tenant=None,
            name="translate",
            version="1.0.0",
            **skill_content(triggers=["translate contract english"], required_inputs=[]),
        ),
        actor=demo.admin,
    )
    suite, _ = suite_install(TINY_SUITE | {"key": "translating", "skill": "translate"})
    EvalThreshold.objects.create(
        tenant=None,
        skill_name="translate",
        suite=suite,
        metric=Metric.CASE_PASS_RATE,
        comparator=Comparator.AT_LEAST,
        value=1.0,
    )
    return version


def recalling(agent: AgentConfig, *, actor) -> None:
    """`agent` made to recall its skills among those its tenant may use."""
    agent.skill_assembly = SkillAssembly.RETRIEVAL
    agent.skills.clear()
    registry_object_save(instance=agent, actor=actor, reason="retrieval")


def skills_run_with(demo, text: str) -> list[str]:
    """The skills in the capability snapshot of a run of acme's agent asked `text`."""
    run = demo_run(demo, text=text)
    run_execute(run_id=str(run.pk))
    run.refresh_from_db()
    return [skill["name"] for skill in run.capability["skills"]]


def test_granting_a_platform_skill_needs_the_gate_met_with_the_models_of_the_agents_given_it(
    demo,
):
    # given weekly-reporter recalling its skills on the offline planner, and a platform-wide
    # translate skill never evaluated with any model
    version = platform_translate(demo)
    recalling(demo.agent, actor=demo.admin)
    reason = "Legal needs contracts translated today; evaluated with the planner tomorrow."

    # when the platform admin grants it to acme, first with no reason, then with one
    with pytest.raises(ReleaseGateFailed) as refused:
        definition_grant(actor=demo.admin, definition=version.skill, tenant=demo.acme)
    while_refused = skills_run_with(demo, TRANSLATE_REQUEST)
    definition_grant(
        actor=demo.admin, definition=version.skill, tenant=demo.acme, override_reason=reason
    )
    once_granted = skills_run_with(demo, TRANSLATE_REQUEST)

    # then the grant was refused for the model of the agent it would give the skill to, and
    # made over the gate only with the reason, which the audit trail keeps
    assert refused.value.message == (
        "translate@1.0.0 does not meet its release gate: no finished eval run of translating "
        "as it is, on this version as it is, with offline-planner (the model of "
        "acme/weekly-reporter)."
    )
    assert (while_refused, once_granted) == ([], ["translate"])
    override = ReleaseOverride.objects.get()
    assert (override.skill_version, override.actor, override.reason) == (
        version,
        demo.admin,
        reason,
    )
    assert override.failures == refused.value.details["failures"]
    history = version.skill.history.order_by("-history_date").first()
    assert history.history_change_reason == (f"granted to acme over its release gate: {reason}")


def test_the_admin_grants_a_platform_skill_over_its_gate_only_with_a_reason(demo):
    # given weekly-reporter recalling its skills on the offline planner, and a platform-wide
    # translate skill never evaluated with any model
    version = platform_translate(demo)
    recalling(demo.agent, actor=demo.admin)
    page = Client()
    page.force_login(demo.admin)
    url = (
        f"/admin/registry/skill/{version.skill.pk}/permissions/"
        f"group-manage/{demo.acme.grant_group_id}/"
    )
    reason = "Legal needs contracts translated today; evaluated with the planner tomorrow."

    # when the platform admin ticks its use for acme's grant group, then does so with a reason
    refused = page.post(url, {"permissions": ["use_skill"]}, follow=True)
    while_refused = tenant_has_grant(tenant=demo.acme, definition=version.skill)
    granted = page.post(url, {"permissions": ["use_skill"], "override_reason": reason})

    # then the first is refused, saying why, and grants nothing; the second is granted over
    # the gate, which the audit trail keeps
    (message,) = refused.context["messages"]
    assert message.level_tag == "error"
    assert str(message).startswith(
        "translate@1.0.0 does not meet its release gate: no finished eval run of translating"
    )
    assert not while_refused
    assert granted.status_code == 302
    assert tenant_has_grant(tenant=demo.acme, definition=version.skill)
    override = ReleaseOverride.objects.get()
    assert (override.skill_version, override.actor, override.reason) == (
        version,
        demo.admin,
        reason,
    )
    history = version.skill.history.order_by("-history_date").first()
    assert history.history_change_reason == f"granted to acme over its release gate: {reason}"


def test_a_platform_skill_granted_again_after_a_withdrawal_is_held_to_its_gate_again(demo):
    # given a platform-wide translate skill, never evaluated, granted to acme over its gate
    # while weekly-reporter recalls its skills
    version = platform_translate(demo)
    recalling(demo.agent, actor=demo.admin)
    definition_grant(
        actor=demo.admin, definition=version.skill, tenant=demo.acme, override_reason="Urgent."
    )

    # when it is granted again while granted, withdrawn, and granted again with no reason
    definition_grant(actor=demo.admin, definition=version.skill, tenant=demo.acme)
    definition_grant(actor=demo.admin, definition=version.skill, tenant=demo.acme, granted=False)
    with pytest.raises(ReleaseGateFailed) as refused:
        definition_grant(actor=demo.admin, definition=version.skill, tenant=demo.acme)

    # then a grant it has already gives no one anything new, and a new one is refused
    assert "with offline-planner (the model of acme/weekly-reporter)" in refused.value.message
    assert not tenant_has_grant(tenant=demo.acme, definition=version.skill)
    assert ReleaseOverride.objects.count() == 1
