"""The running example as seed_demo loads it, the shipped suites, a two-case suite with a
release gate on weekly-summary, drafts to evaluate, and eval runs driven to their end in the
test's own process."""

from collections.abc import Callable

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from evaluations import services
from evaluations.choices import Comparator, Metric
from evaluations.models import EvalRun, EvalSuite, EvalThreshold
from evaluations.starter import suite_install, suites_install
from registry.choices import ModelProvider
from registry.demo import DEMO_PASSWORD
from registry.models import ModelConfig, SkillVersion
from registry.models.skills import SKILL_CONTENT_FIELDS
from registry.services import skills
from registry.services.common import registry_object_save
from registry.services.tenancy import api_token_issue
from tests.runs import conftest as runs_fixtures

demo = runs_fixtures.demo

APOLLO = {
    "key": "apollo",
    "name": "Project Apollo",
    "updates": [["task", "API gateway migration", "done", "Moved.", 0]],
    "leads": [["dir-1001", "Li Wei", "li.wei@acme.example", 3]],
}
TINY_SUITE = {
    "key": "tiny",
    "name": "Two cases",
    "kind": "task",
    "skill": "weekly-summary",
    "cases": [
        {
            "key": "complete",
            "title": "Everything known",
            "messages": ["Summarise Apollo's week for the R&D lead."],
            "metadata": {"project_id": "apollo"},
            "projects": [APOLLO],
            "expected": {"status": "WAITING_APPROVAL"},
        },
        {
            "key": "no-scope",
            "title": "No project",
            "messages": ["Summarise this week's project status."],
            "projects": [APOLLO],
            "expected": {"status": "NEEDS_CLARIFICATION"},
        },
    ],
}


def api_as(username: str, tenant) -> APIClient:
    _, key = api_token_issue(username=username, password=DEMO_PASSWORD, tenant_slug=tenant.slug)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client


@pytest.fixture
def dave(demo):
    return get_user_model().objects.get(username="dave")


@pytest.fixture
def suites(demo) -> dict[str, EvalSuite]:
    return {suite.key: suite for suite, _ in suites_install()}


@pytest.fixture
def tiny(demo) -> EvalSuite:
    """Two cases, and the release gate of weekly-summary: all of them must pass."""
    suite, _ = suite_install(TINY_SUITE)
    EvalThreshold.objects.create(
        tenant=demo.acme,
        skill_name="weekly-summary",
        suite=suite,
        metric=Metric.CASE_PASS_RATE,
        comparator=Comparator.AT_LEAST,
        value=1.0,
    )
    return suite


@pytest.fixture
def draft(demo, dave) -> Callable[..., SkillVersion]:
    """A draft of weekly-summary like 3.2.0; `workflow=""` makes one that never asks for an
    approval (the generic agent loop), which the tiny suite fails."""
    current = SkillVersion.objects.get(skill__name="weekly-summary", version="3.2.0")

    def make(version: str, **changes) -> SkillVersion:
        content = {field: getattr(current, field) for field in SKILL_CONTENT_FIELDS}
        return skills.skill_version_create(
            actor=dave,
            tenant=demo.acme,
            name="weekly-summary",
            version=version,
            tool_versions=[dep.tool_version for dep in current.tool_dependencies.all()],
            **{**content, **changes},
        )

    return make


@pytest.fixture
def adversary(demo) -> ModelConfig:
    """The adversarial planner: a model that obeys every instruction it finds in data."""
    return registry_object_save(
        instance=ModelConfig(
            name="adversary", provider=ModelProvider.ADVERSARIAL, model_name="adversarial-planner"
        ),
        actor=demo.admin,
    )


@pytest.fixture
def evaluate(demo, dave, suites) -> Callable[..., EvalRun]:
    """Start an eval run as dave (acme's publisher) and run all its cases here. `suite` is a
    suite or the key of a shipped one; `version` a version or weekly-summary's number."""

    def run(suite, *, version="3.2.0", model_config=None) -> EvalRun:
        if isinstance(version, str):
            version = SkillVersion.objects.get(skill__name="weekly-summary", version=version)
        eval_run, _ = services.eval_run_start(
            actor=dave,
            suite=suites[suite] if isinstance(suite, str) else suite,
            skill_version=version,
            agent_config=demo.agent,
            model_config=model_config,
        )
        services.eval_run_advance(eval_run_id=eval_run.pk)
        return EvalRun.objects.get(pk=eval_run.pk)

    return run
