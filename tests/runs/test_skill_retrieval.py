"""Retrieval-based skill assembly: skills recalled from the registry by PostgreSQL full-text
search over their triggers, description and examples, filtered by authorisation, rollout and
dependency health, and used only when they score at least the agent's threshold."""

from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from django.contrib.auth import get_user_model
from django.db import connection

from registry.choices import NoSkillMatched, SkillAssembly, VersionStatus
from registry.models import SkillVersion
from registry.selectors import skills_recall
from registry.services import skills
from registry.services.common import registry_object_save
from registry.services.lifecycle import version_revoke
from registry.services.tenancy import definition_grant
from runs.choices import RunStatus
from runs.loop import run_execute
from runs.models import ToolCall
from runs.tools import limits
from tests.registry.factories import skill_content
from tests.runs.conftest import RUNNING_EXAMPLE_TEXT, demo_run, events_of

CATALOGUE = yaml.safe_load((Path(__file__).parent / "skill_catalogue.yaml").read_text())
DEFAULT_MIN_SCORE = 0.08


def publish_catalogue(*, tenant, actor, skip=()) -> None:
    for entry in CATALOGUE["skills"]:
        if entry["name"] in skip:
            continue
        draft = skills.skill_version_create(
            actor=actor,
            tenant=tenant,
            name=entry["name"],
            version="1.0.0",
            **skill_content(
                description=entry["description"], triggers=entry["triggers"], required_inputs=[]
            ),
        )
        skills.skill_version_publish(skill_version=draft, actor=actor)


@pytest.fixture
def catalogue(acme, publisher):
    """The fifty skills, published by acme."""
    publish_catalogue(tenant=acme, actor=publisher)


def top_skill(tenant, text: str) -> str | None:
    recalled = skills_recall(tenant=tenant, text=text)
    return recalled[0].skill.name if recalled and recalled[0].score >= DEFAULT_MIN_SCORE else None


def test_the_right_skill_among_fifty_is_recalled_for_requests_in_other_words(acme, catalogue):
    """Every request in both languages; a mismatch shows in the diff with its text."""
    requests = CATALOGUE["requests"]

    recalled = {item["text"]: top_skill(acme, item["text"]) for item in requests}

    assert recalled == {item["text"]: item["skill"] for item in requests}


def test_a_request_no_skill_serves_is_not_forced_onto_one(acme, catalogue):
    assert {text: top_skill(acme, text) for text in CATALOGUE["unrelated"]} == dict.fromkeys(
        CATALOGUE["unrelated"]
    )


def test_the_plain_fallback_of_the_embedded_database_recalls_nearly_as_well(
    acme, catalogue, monkeypatch
):
    """Without PostgreSQL there is no stemming ("OKRs" misses "okr"), so a few paraphrases
    miss; unrelated requests are still declined."""
    monkeypatch.setattr(connection, "vendor", "sqlite")

    right = sum(top_skill(acme, item["text"]) == item["skill"] for item in CATALOGUE["requests"])

    assert right >= len(CATALOGUE["requests"]) - 3
    assert not any(top_skill(acme, text) for text in CATALOGUE["unrelated"])


def test_recall_sees_only_published_skills_the_tenant_may_use(
    acme, globex, publisher, globex_publisher, platform_admin
):
    text = "Please translate this contract into English"
    content = skill_content(triggers=["translate contract english"], required_inputs=[])
    for tenant, actor, name in [
        (globex, globex_publisher, "globex-translate"),
        (None, platform_admin, "platform-translate"),
    ]:
        draft = skills.skill_version_create(
            actor=actor, tenant=tenant, name=name, version="1.0.0", **content
        )
        skills.skill_version_publish(skill_version=draft, actor=actor)
    skills.skill_version_create(
        actor=publisher, tenant=acme, name="draft-translate", version="1.0.0", **content
    )
    revoked = skills.skill_version_create(
        actor=publisher, tenant=acme, name="revoked-translate", version="1.0.0", **content
    )
    skills.skill_version_publish(skill_version=revoked, actor=publisher)
    version_revoke(version=revoked, actor=publisher, reason="withdrawn")

    assert skills_recall(tenant=acme, text=text) == []
    assert [item.skill.name for item in skills_recall(tenant=globex, text=text)] == [
        "globex-translate"
    ]


@pytest.mark.parametrize("vendor", ["postgresql", "sqlite"])
def test_skills_of_one_name_and_score_are_recalled_the_tenant_s_own_first(
    acme, publisher, platform_admin, monkeypatch, vendor
):
    # given the platform's translate skill granted to acme, and acme's own copy of it
    content = skill_content(triggers=["translate contract english"], required_inputs=[])
    for tenant, actor, namespace in [
        (None, platform_admin, "core"),
        (None, platform_admin, "legal"),
        (acme, publisher, "legal"),
        (acme, publisher, "core"),
    ]:
        draft = skills.skill_version_create(
            actor=actor,
            tenant=tenant,
            name="translate",
            namespace=namespace,
            version="1.0.0",
            **content,
        )
        skills.skill_version_publish(skill_version=draft, actor=actor)
        if tenant is None:
            definition_grant(actor=platform_admin, definition=draft.skill, tenant=acme)
    monkeypatch.setattr(connection, "vendor", vendor)

    # when a request scores them all alike
    recalled = skills_recall(tenant=acme, text="Please translate this contract into English")

    # then the tie is broken the same way every time: acme's own first, then by namespace
    assert len({item.score for item in recalled}) == 1
    assert [(item.skill.tenant_id, item.skill.namespace) for item in recalled] == [
        (acme.pk, "core"),
        (acme.pk, "legal"),
        (None, "core"),
        (None, "legal"),
    ]


# --- through a run: the demo's agent switched to retrieval ---------------------------------


@pytest.fixture
def retrieval_agent(demo):
    """acme's weekly-reporter recalling its skill from acme's registry of fifty."""
    dave = get_user_model().objects.get(username="dave")
    publish_catalogue(tenant=demo.acme, actor=dave, skip={"weekly-summary"})
    demo.agent.skill_assembly = SkillAssembly.RETRIEVAL
    demo.agent.skills.clear()
    registry_object_save(instance=demo.agent, actor=demo.admin, reason="retrieval")
    return demo.agent


def test_a_retrieval_run_uses_the_recalled_skill_and_says_why(demo, retrieval_agent):
    run = demo_run(demo, project_id="apollo")
    run_execute(run_id=str(run.pk))
    run.refresh_from_db()

    assert run.status == RunStatus.WAITING_APPROVAL
    assert run.skill == "weekly-summary@3.2.0"
    assert run.capability["assembly"]["mode"] == SkillAssembly.RETRIEVAL
    assert run.capability["skills"][0]["name"] == "weekly-summary"
    assert run.capability["skills"][0]["score"] >= DEFAULT_MIN_SCORE
    [route] = events_of(run, "route.selected")
    assert route["skill"] == "weekly-summary@3.2.0"
    assert route["why"][0].startswith("recalled weekly-summary with score")


def test_an_unmatched_request_is_answered_without_tools_or_asked_about(demo, retrieval_agent):
    answered = demo_run(demo, text="明天北京天气怎么样")
    run_execute(run_id=str(answered.pk))
    retrieval_agent.when_no_skill_matches = NoSkillMatched.CLARIFY
    registry_object_save(instance=retrieval_agent, actor=demo.admin, reason="clarify")
    asked = demo_run(demo, text="Tell me a joke about cats")
    run_execute(run_id=str(asked.pk))
    answered.refresh_from_db()
    asked.refresh_from_db()

    assert (answered.status, answered.skill, answered.capability["skills"]) == (
        RunStatus.COMPLETED,
        "",
        [],
    )
    assert events_of(answered, "route.selected")[0]["mode"] == "direct_answer"
    assert (asked.status, asked.reason_code) == (RunStatus.NEEDS_CLARIFICATION, "NO_SKILL_MATCHED")
    assert events_of(asked, "route.selected")[0]["clarification"] == ["skill"]
    assert not ToolCall.objects.filter(run__in=[answered, asked]).exists()


def test_the_answer_to_which_task_is_about_the_project_the_question_followed(demo, retrieval_agent):
    """Before, asking which task left the session on the project named before the question,
    so the user's answer, naming no project, was about that other project."""
    # given alice's session is on apollo
    retrieval_agent.when_no_skill_matches = NoSkillMatched.CLARIFY
    registry_object_save(instance=retrieval_agent, actor=demo.admin, reason="clarify")
    first = demo_run(demo, project_id="apollo")
    run_execute(run_id=str(first.pk))
    # when she names hermes in words no skill matches, is asked which task, and says it
    asked = demo_run(
        demo, session_id=first.session_id, text="Tell me a joke about cats", project_id="hermes"
    )
    run_execute(run_id=str(asked.pk))
    asked.refresh_from_db()
    assert (asked.status, asked.reason_code) == (RunStatus.NEEDS_CLARIFICATION, "NO_SKILL_MATCHED")
    answer = demo_run(demo, session_id=first.session_id)
    run_execute(run_id=str(answer.pk))

    # then her answer is about hermes
    answer.refresh_from_db()
    assert answer.state["inputs"]["project_id"] == "hermes"


def test_a_skill_below_the_threshold_is_not_used_and_the_best_is_named(demo, retrieval_agent):
    retrieval_agent.skill_min_score = Decimal("0.95")
    registry_object_save(instance=retrieval_agent, actor=demo.admin, reason="strict")

    run = demo_run(demo, project_id="apollo")

    assert run.capability["skills"] == []
    assert run.capability["assembly"]["recalled"][0]["skill"] == "weekly-summary"
    run_execute(run_id=str(run.pk))
    [route] = events_of(run, "route.selected")
    assert route["skill"] is None
    assert route["why"][0].startswith("no usable skill scored at least 0.950 (best: weekly-summary")


def test_a_recalled_skill_whose_tool_is_failing_gives_way_to_the_next(demo, retrieval_agent):
    weekly = SkillVersion.objects.get(skill__name="weekly-summary", status=VersionStatus.PUBLISHED)
    project_search = weekly.tool_dependencies.get(
        tool_version__tool__name="project_search"
    ).tool_version
    assert project_search.circuit_breaker
    for _ in range(project_search.circuit_breaker["failure_threshold"]):
        [passage] = limits.calls_enter([project_search], tenant_id=demo.acme.pk)
        limits.calls_leave([(passage, True)])
    dave = get_user_model().objects.get(username="dave")
    draft = skills.skill_version_create(
        actor=dave,
        tenant=demo.acme,
        name="status-digest",
        version="1.0.0",
        **skill_content(triggers=["汇总本周项目状态"], required_inputs=[]),
    )
    skills.skill_version_publish(skill_version=draft, actor=dave)

    run = demo_run(demo)

    assert run.skill == "status-digest@1.0.0"
    assert {"skill": "weekly-summary", "reason": "DEPENDENCY_UNAVAILABLE"} in run.capability[
        "excluded"
    ]
    assert {
        "tool": project_search.qualified_name,
        "reason": "CIRCUIT_OPEN",
    } in run.capability["excluded"]


def test_the_running_example_text_recalls_the_demo_skill(demo, retrieval_agent):
    assert skills_recall(tenant=demo.acme, text=RUNNING_EXAMPLE_TEXT)[0].skill.name == (
        "weekly-summary"
    )
