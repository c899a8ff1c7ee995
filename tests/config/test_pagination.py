"""Every paginated list of the API is in a total order: walked page by page, it gives each row
exactly once, even where rows share the time they are ordered by."""

import uuid
from collections import Counter

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone

from approvals.models import BusinessAction, Handoff
from evaluations.models import EvalRun, EvalSuite
from registry.choices import Risk
from registry.models import Policy, SkillVersion, ToolVersion
from registry.services import skills, tools
from registry.services.common import registry_object_save
from runs.loop import run_execute
from runs.models import Run
from tests.approvals.conftest import waiting_run
from tests.evaluations.conftest import api_as
from tests.registry.factories import skill_content, tool_content
from tests.runs import conftest as runs_fixtures
from tests.runs.conftest import demo_run

demo = runs_fixtures.demo

TIED = 8
INSTANT = timezone.now().replace(microsecond=0)


def _tie(model, rows) -> list[str]:
    """The ids of `rows`, all given one creation time."""
    model.objects.filter(pk__in=[row.pk for row in rows]).update(created_at=INSTANT)
    return [str(row.pk) for row in rows]


def _copies(row, count: int, **fields_of) -> list:
    """`row` and `count - 1` copies of it, each with the fields `fields_of[name](index)`."""
    rows = [row]
    for index in range(1, count):
        copy = type(row).objects.get(pk=row.pk)
        copy.pk = uuid.uuid4()
        copy._state.adding = True
        for name, value_of in fields_of.items():
            setattr(copy, name, value_of(index))
        copy.save()
        rows.append(copy)
    return rows


def _user(username: str):
    return get_user_model().objects.get(username=username)


def _runs(demo):
    runs = [demo_run(demo) for _ in range(TIED)]
    return "alice", "/api/v1/runs", _tie(Run, runs)


def _approvals(demo):
    _, action = waiting_run(demo)
    actions = _copies(
        action,
        TIED,
        run=lambda index: demo_run(demo),
        idempotency_key=lambda index: f"{action.idempotency_key}:{index}",
    )
    return "bob", "/api/v1/approvals", _tie(BusinessAction, actions)


def _handoffs(demo):
    policy = Policy.objects.get(agent_configs=demo.agent)
    policy.human_queue_risks = [Risk.EXTERNAL_SIDE_EFFECT]
    registry_object_save(instance=policy, actor=demo.admin, reason="people send mail")
    run = demo_run(demo, project_id="apollo")
    run_execute(run_id=str(run.pk))
    handoff = Handoff.objects.get(run=run)
    capability = Run.objects.get(pk=run.pk).capability

    def another_run(index: int) -> Run:
        other = demo_run(demo)
        Run.objects.filter(pk=other.pk).update(capability=capability)
        return other

    return "bob", "/api/v1/handoffs", _tie(Handoff, _copies(handoff, TIED, run=another_run))


def _tools(demo):
    dave = _user("dave")
    versions = [
        tools.tool_version_create(
            actor=dave, tenant=demo.acme, name="tied", version=f"1.0.{index}", **tool_content()
        )
        for index in range(TIED)
    ]
    return "dave", "/api/v1/tools?name=tied", _tie(ToolVersion, versions)


def _skills(demo):
    dave = _user("dave")
    versions = [
        skills.skill_version_create(
            actor=dave,
            tenant=demo.acme,
            name="tied",
            version=f"1.0.{index}",
            tool_versions=(),
            **skill_content(),
        )
        for index in range(TIED)
    ]
    return "dave", "/api/v1/skills?name=tied", _tie(SkillVersion, versions)


def _eval_suites(demo):
    # A tenant's suite may have the key of a platform suite.
    suites = [
        EvalSuite.objects.create(
            tenant=tenant, key=f"tied-{index}", name="Tied", kind="task", skill_name="tied"
        )
        for index in range(TIED // 2)
        for tenant in (None, demo.acme)
    ]
    return "dave", "/api/v1/evaluations/suites", [str(suite.pk) for suite in suites]


def _eval_runs(demo):
    suite = EvalSuite.objects.create(key="tied", name="Tied", kind="task", skill_name="tied")
    version = SkillVersion.objects.get(skill__name="weekly-summary", version="3.2.0")
    eval_runs = [
        EvalRun.objects.create(
            tenant=demo.acme,
            suite=suite,
            skill_version=version,
            agent_config=demo.agent,
            model_config=demo.agent.model_config,
            created_by=_user("dave"),
        )
        for _ in range(TIED)
    ]
    return "dave", "/api/v1/evaluations/runs", _tie(EvalRun, eval_runs)


def _page(client, url: str, **query):
    separator = "&" if "?" in url else "?"
    response = client.get(url + separator + "&".join(f"{k}={v}" for k, v in query.items()))
    assert response.status_code == 200, response.content
    return response.json()


def _walked(client, url: str) -> list[str]:
    """The ids of every page of `url`, one row a page."""
    ids, page = [], 1
    while True:
        response = _page(client, url, page_size=1, page=page)
        ids += [row["id"] for row in response["results"]]
        if response["next"] is None:
            return ids
        page += 1


@pytest.mark.parametrize(
    "make",
    [_runs, _approvals, _handoffs, _tools, _skills, _eval_suites, _eval_runs],
    ids=lambda make: make.__name__.strip("_"),
)
def test_walking_a_list_one_row_a_page_gives_each_row_once(demo, make):
    # given rows the list orders by a value they share, read by a plan that sorts them (the
    # planner's choice for a few rows among many) rather than in the order of an index
    username, url, tied = make(demo)
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_indexscan = off")
    client = api_as(username, demo.acme)
    listed = [row["id"] for row in _page(client, url, page_size=200)["results"]]
    assert set(tied) <= set(listed)

    # when the list is walked one row a page
    walked = _walked(client, url)

    # then each row comes exactly once, in the order of the whole list
    assert Counter(walked) == Counter(listed)
    assert walked == listed
