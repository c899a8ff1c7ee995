"""A page or an API list costs the same number of queries however many rows it shows, and
a figure is counted by the database, not by reading every row into the process."""

import uuid
from datetime import timedelta

import pytest
from django.contrib.admin import site as admin_site
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from approvals import services as approval_services
from approvals.choices import Decision, HandoffStatus
from approvals.models import BusinessAction, Handoff
from evaluations.models import EvalCase, EvalCaseResult, EvalRun, EvalSuite
from registry.demo import DEMO_PASSWORD
from registry.models import McpServer, ModelConfig, SkillVersion, ToolVersion
from registry.services.tenancy import api_token_issue
from runs.loop import run_execute
from runs.models import Run, TaskOccurrence
from tests.approvals import test_sensitive_fields
from tests.approvals.conftest import waiting_run
from tests.runs import conftest as runs_fixtures
from tests.runs.conftest import demo_run
from tests.runs.test_schedules import task_of

pytestmark = pytest.mark.django_db

demo = runs_fixtures.demo
demo_names_sensitive = test_sensitive_fields.demo_names_sensitive


def _user(username: str):
    return get_user_model().objects.get(username=username)


def _page_client(username: str) -> Client:
    client = Client()
    client.force_login(_user(username))
    return client


def _api_client(username: str) -> APIClient:
    _, key = api_token_issue(username=username, password=DEMO_PASSWORD, tenant_slug="acme")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client


def _queries(client, url: str) -> int:
    with CaptureQueriesContext(connection) as captured:
        response = client.get(url)
    assert response.status_code == 200, (url, response.status_code)
    return len(captured.captured_queries)


def _same_with_more_rows(add, measure) -> None:
    """`measure` after `add(3)` and after `add(9)` more: the same (measured twice at first,
    the first time also filling what a process caches)."""
    add(3)
    measure()
    few = measure()
    add(9)
    assert measure() == few


def _decided(demo, count: int) -> None:
    for _ in range(count):
        run = demo_run(demo, project_id="apollo")
        run_execute(run_id=str(run.pk))
        action = BusinessAction.objects.get(run=Run.objects.get(pk=run.pk))
        approval_services.approval_decide(
            action_id=action.pk,
            approver=_user("bob"),
            decision=Decision.REJECT,
            payload_hash=action.payload_hash,
        )


def _suites(demo, count: int) -> list[EvalSuite]:
    start = EvalSuite.objects.count()
    return [
        EvalSuite.objects.create(
            tenant=demo.acme,
            key=f"suite-{start + index}",
            name="Suite",
            kind="task",
            skill_name="weekly-summary",
        )
        for index in range(count)
    ]


def test_the_approvals_api_lists_decided_actions_in_fixed_queries(demo):
    client = _api_client("bob")

    _same_with_more_rows(
        lambda count: _decided(demo, count), lambda: _queries(client, "/api/v1/approvals")
    )


def test_the_runs_api_masks_what_tools_returned_under_sensitive_fields_in_fixed_queries(
    demo_names_sensitive,
):
    def add(count: int) -> None:
        for _ in range(count):
            waiting_run(demo_names_sensitive)

    client = _api_client("carol")

    _same_with_more_rows(add, lambda: _queries(client, "/api/v1/runs"))
    assert "Li Wei" not in client.get("/api/v1/runs").content.decode()


def test_the_evaluation_suites_api_and_admin_list_suites_in_fixed_queries(demo):
    api, admin = _api_client("dave"), _page_client("admin")

    _same_with_more_rows(
        lambda count: _suites(demo, count),
        lambda: (
            _queries(api, "/api/v1/evaluations/suites"),
            _queries(admin, "/admin/evaluations/evalsuite/"),
        ),
    )


def test_the_handoff_admin_lists_handled_handoffs_in_fixed_queries(demo):
    def add(count: int) -> None:
        for _ in range(count):
            Handoff.objects.create(
                tenant=demo.acme,
                run=demo_run(demo, project_id="apollo"),
                requester=demo.alice,
                skill="weekly-summary@3.2.0",
                risks=[],
                request="Please look.",
                status=HandoffStatus.HANDLED,
                resolved_by=_user("bob"),
                note="Done.",
                resolved_at=timezone.now(),
            )

    admin = _page_client("admin")
    _same_with_more_rows(add, lambda: _queries(admin, "/admin/approvals/handoff/"))


def test_the_mcp_server_and_tool_version_admins_find_drift_once_per_page(demo):
    base = ToolVersion.objects.get(tool__name="project_search", version="2.0.0")

    def add(count: int) -> None:
        for _ in range(count):
            name = f"server-{uuid.uuid4().hex[:8]}"
            McpServer.objects.create(
                tenant=demo.acme,
                name=name,
                transport=McpServer.Transport.STREAMABLE_HTTP,
                url=f"https://{name}.example.com/mcp",
            )
            version = ToolVersion.objects.get(pk=base.pk)
            version.pk = version.id = uuid.uuid4()
            version.version, version.status = f"9.{uuid.uuid4().int % 10**6}.0", "draft"
            version.published_at = version.published_by = None
            version.adapter_kind = "mcp"
            version.adapter_config = {
                "server": name,
                "remote_name": "search",
                "definition_hash": "0" * 64,
            }
            version.save()

    admin = _page_client("admin")
    _same_with_more_rows(
        add,
        lambda: (
            _queries(admin, "/admin/registry/mcpserver/"),
            _queries(admin, "/admin/registry/toolversion/"),
        ),
    )


def test_an_evaluation_s_admin_pages_show_cases_and_results_in_fixed_queries(demo):
    (suite,) = _suites(demo, 1)
    eval_run = EvalRun.objects.create(
        tenant=demo.acme,
        suite=suite,
        skill_version=SkillVersion.objects.get(skill__name="weekly-summary", version="3.2.0"),
        model_config=ModelConfig.objects.get(name="offline-planner"),
        agent_config=demo.agent,
        created_by=_user("dave"),
        skill_content_hash="0" * 64,
        suite_content_hash="0" * 64,
    )

    def add(count: int) -> None:
        for _ in range(count):
            case = EvalCase.objects.create(
                suite=suite,
                key=f"case-{uuid.uuid4().hex[:8]}",
                title="Case",
                messages=["Hi"],
                expected={},
            )
            EvalCaseResult.objects.create(eval_run=eval_run, case=case, passed=True, observed={})

    admin = _page_client("admin")
    _same_with_more_rows(
        add,
        lambda: (
            _queries(admin, f"/admin/evaluations/evalrun/{eval_run.pk}/change/"),
            _queries(admin, f"/admin/evaluations/evalsuite/{suite.pk}/change/"),
        ),
    )


def test_a_scheduled_task_s_admin_page_shows_its_occurrences_in_fixed_queries(demo):
    task = task_of(demo)

    def add(count: int) -> None:
        start = TaskOccurrence.objects.count()
        for index in range(count):
            TaskOccurrence.objects.create(
                task=task,
                owner=demo.alice,
                message={},
                slot=timezone.now() - timedelta(days=start + index + 1),
                deadline_at=timezone.now(),
            )

    admin = _page_client("admin")
    _same_with_more_rows(
        add, lambda: _queries(admin, f"/admin/runs/scheduledtask/{task.pk}/change/")
    )


def test_the_dashboard_counts_approvals_in_the_database(demo):
    carol = _page_client("carol")

    def read_rows() -> list:
        with CaptureQueriesContext(connection) as captured:
            response = carol.get("/runs/dashboard/")
        assert response.status_code == 200
        return [
            query["sql"] for query in captured.captured_queries if '"runs_span"' in query["sql"]
        ], response.context["figures"].approvals

    _decided(demo, 2)
    queries, approvals = read_rows()
    assert (approvals["count"], approvals["accepted"], approvals["rate"]) == (2, 0, 0)
    assert not any('SELECT "runs_span"."attributes"' in sql for sql in queries)


@pytest.mark.parametrize(
    "url", ["/admin/", "/admin/registry/toolversion/", "/admin/registry/skillversion/"]
)
def test_a_staff_member_s_admin_page_asks_for_their_scope_once_per_action(demo, url):
    """The navigation lists every admin, and each asks for several permissions; a publisher's
    page asked the database whether their tenants allow it for each of them (101 queries for
    the index), where the answer depends only on the action."""
    client = _page_client("dave")
    client.get(url)

    queries = _queries(client, url)

    assert queries < len(admin_site._registry) / 2


@pytest.mark.parametrize("model", [ToolVersion, SkillVersion])
def test_an_object_s_history_page_names_its_records_in_fixed_queries(demo, model):
    """Each record is named by its object as it was, whose name reads a related row (the
    tool of a version): the records are read with it, and naming them reads it no more."""
    changed = model.objects.first()
    url = f"/admin/registry/{model._meta.model_name}/{changed.pk}/history/"
    admin = _page_client("admin")

    def add(count: int) -> None:
        for _ in range(count):
            changed.save()

    _same_with_more_rows(add, lambda: _queries(admin, url))
