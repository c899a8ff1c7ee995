"""Release gates: publishing a skill version, or moving an agent to another model, needs a
finished eval run of exactly that version (and model) meeting every threshold of the skill."""

import copy
import threading

import pytest
from django import forms
from django.db import connection
from django.test import Client
from django.utils import timezone

from evaluations.choices import EvalRunStatus
from evaluations.errors import PermissionDenied, ReleaseGateFailed
from evaluations.gates import release_gate_check, skill_content_hash, suite_content_hash
from evaluations.models import EvalRun, ReleaseOverride
from evaluations.starter import suite_install
from registry.choices import SkillAssembly, VersionStatus
from registry.errors import VersionImmutable
from registry.models import AgentConfig, RolloutFlag, SkillVersion
from registry.models.skills import SKILL_CONTENT_FIELDS
from registry.services import skills
from registry.services.common import registry_object_save
from tests.evaluations.conftest import APOLLO, TINY_SUITE, api_as


def admin_form_data(page: Client, agent: AgentConfig) -> dict:
    """What the admin's change form of `agent` submits when saved as it is shown."""
    form = page.get(f"/admin/registry/agentconfig/{agent.pk}/change/").context["adminform"].form
    data = {}
    for name, field in form.fields.items():
        value = form.initial.get(name)
        if isinstance(field, forms.BooleanField):
            data |= {name: "on"} if value else {}
        elif value is not None:
            data[name] = field.widget.format_value(field.prepare_value(value))
    return data | {"skills": [skill.pk for skill in agent.skills.all()]}


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


def test_moving_an_agent_to_another_model_needs_the_gate_met_with_that_model(
    evaluate, demo, dave, tiny, adversary
):
    current = SkillVersion.objects.get(skill__name="weekly-summary", version="3.2.0")

    refused = moved_once_evaluated(evaluate, demo, tiny, demo.agent, adversary, current)

    assert "weekly-summary@3.2.0: no finished eval run of tiny" in refused.message


def test_moving_an_agent_that_recalls_its_skills_needs_the_gate_met_for_those_it_may_recall(
    evaluate, demo, dave, tiny, adversary
):
    # given an agent of acme with no skill of its own, which recalls among acme's skills
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
