"""The tenant-isolation matrix, generated from the URL conf: every API endpoint and page is
requested anonymously, by a user of another tenant (holding every role there) and by a user
of the right tenant without the role; no data of acme ever appears in what they get, and the
status is the one DESIGN.md gives (401 or a login redirect, 403, 404). A route added without
an entry here fails the first test."""

import uuid
from dataclasses import dataclass

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import get_resolver
from django.urls.resolvers import URLPattern, URLResolver
from django.utils import timezone
from rest_framework.test import APIClient

from approvals.models import BusinessAction
from approvals.services import handoff_open
from evaluations.services import eval_run_start
from evaluations.starter import suites_install
from examples.models import Project, ProjectUpdate
from registry.choices import Role
from registry.demo import DEMO_PASSWORD
from registry.models import SkillVersion, Tenant, ToolVersion
from registry.services.tenancy import api_token_issue, membership_add
from runs.loop import run_execute
from runs.services.memory import memory_write
from tests.runs.conftest import demo, demo_run  # noqa: F401 (fixture)

# Routes nobody needs to be signed in for, and the admin (its own permission system).
PUBLIC = {"home", "login", "logout", "auth-token", "schema", "api-docs"}

ANONYMOUS_API = 401
# A task of acme's project that only those who may see the project ever read.
PRIVATE = "ACME-PRIVATE-7731"
LOGIN_REDIRECT = 302


@dataclass(frozen=True)
class Entry:
    """How a route is requested and what each outsider gets."""

    path: str
    method: str = "get"
    other_tenant: int = 404
    wrong_role: int = 404


ENTRIES = {
    "tool-version-list": Entry("/api/v1/tools", other_tenant=200, wrong_role=200),
    "tool-version-detail": Entry("/api/v1/tools/{tool}", wrong_role=200),
    "tool-version-deprecate": Entry("/api/v1/tools/{tool}/deprecate", "post", wrong_role=403),
    "tool-version-publish": Entry("/api/v1/tools/{tool}/publish", "post", wrong_role=403),
    "tool-version-revoke": Entry("/api/v1/tools/{tool}/revoke", "post", wrong_role=403),
    "tool-version-rollback": Entry("/api/v1/tools/{tool}/rollback", "post", wrong_role=403),
    "skill-version-list": Entry("/api/v1/skills", other_tenant=200, wrong_role=200),
    "skill-version-detail": Entry("/api/v1/skills/{skill}", wrong_role=200),
    "skill-version-deprecate": Entry("/api/v1/skills/{skill}/deprecate", "post", wrong_role=403),
    "skill-version-publish": Entry("/api/v1/skills/{skill}/publish", "post", wrong_role=403),
    "skill-version-revoke": Entry("/api/v1/skills/{skill}/revoke", "post", wrong_role=403),
    "skill-version-rollback": Entry("/api/v1/skills/{skill}/rollback", "post", wrong_role=403),
    "messages": Entry("/api/v1/messages", "post", other_tenant=400, wrong_role=400),
    "attachments": Entry("/api/v1/attachments", "post", other_tenant=415, wrong_role=415),
    "run-list": Entry("/api/v1/runs", other_tenant=200, wrong_role=200),
    "run-detail": Entry("/api/v1/runs/{run}"),
    "run-cancel": Entry("/api/v1/runs/{run}/cancel", "post"),
    "run-events": Entry("/api/v1/runs/{run}/events"),
    "run-stream": Entry("/api/v1/runs/{run}/stream"),
    "memory-list": Entry("/api/v1/memories", other_tenant=200, wrong_role=200),
    "memory-detail": Entry("/api/v1/memories/{memory}", "delete"),
    "approval-list": Entry("/api/v1/approvals", other_tenant=200, wrong_role=200),
    "approval-detail": Entry("/api/v1/approvals/{action}"),
    "approval-decision": Entry("/api/v1/approvals/{action}/decision", "post", wrong_role=403),
    "handoff-list": Entry("/api/v1/handoffs", other_tenant=200, wrong_role=200),
    "handoff-detail": Entry("/api/v1/handoffs/{handoff}"),
    "handoff-resolve": Entry("/api/v1/handoffs/{handoff}/resolve", "post", wrong_role=403),
    "eval-suite-list": Entry("/api/v1/evaluations/suites", other_tenant=200, wrong_role=200),
    "eval-suite-detail": Entry("/api/v1/evaluations/suites/{suite}", other_tenant=200),
    "eval-run-list": Entry("/api/v1/evaluations/runs", other_tenant=200, wrong_role=200),
    "eval-run-detail": Entry("/api/v1/evaluations/runs/{eval_run}"),
    "eval-run-cancel": Entry("/api/v1/evaluations/runs/{eval_run}/cancel", "post"),
    "eval-run-results": Entry("/api/v1/evaluations/runs/{eval_run}/results"),
    "approvals:queue": Entry("/approvals/", other_tenant=200, wrong_role=200),
    "approvals:action": Entry("/approvals/{action}/"),
    "approvals:handoffs": Entry("/approvals/handoffs/", other_tenant=200, wrong_role=200),
    "approvals:handoff": Entry("/approvals/handoffs/{handoff}/"),
    "runs:history": Entry("/runs/", other_tenant=200, wrong_role=403),
    "runs:dashboard": Entry("/runs/dashboard/", other_tenant=200, wrong_role=403),
    "runs:detail": Entry("/runs/{run}/"),
    "runs:export": Entry("/runs/{run}/export.json"),
    "runs:stream": Entry("/runs/{run}/stream"),
    "evaluations:list": Entry("/evaluations/", other_tenant=200, wrong_role=403),
    # Back to the list, told to choose two runs of their own: acme's answer as none.
    "evaluations:compare": Entry(
        "/evaluations/compare/?a={eval_run}&b={eval_run}", other_tenant=302, wrong_role=403
    ),
    "evaluations:detail": Entry("/evaluations/{eval_run}/", wrong_role=403),
    "registry-history": Entry("/registry/history/", other_tenant=200, wrong_role=403),
    "memories": Entry("/memories/", other_tenant=200, wrong_role=200),
}


def _routes(patterns, namespace: str = "") -> set[str]:
    names = set()
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            if str(pattern.pattern).startswith("admin/"):
                continue
            inner = f"{namespace}{pattern.namespace}:" if pattern.namespace else namespace
            names |= _routes(pattern.url_patterns, inner)
        elif isinstance(pattern, URLPattern) and pattern.name:
            names.add(f"{namespace}{pattern.name}")
    return names


def test_every_route_has_an_entry_in_the_matrix():
    routes = _routes(get_resolver().url_patterns) - PUBLIC

    assert routes - set(ENTRIES) == set(), "add the new routes to the isolation matrix"
    assert set(ENTRIES) - routes == set()


@pytest.fixture
def world(demo):  # noqa: F811
    """acme's objects of every kind, and the people who must not reach them."""
    User = get_user_model()
    ProjectUpdate.objects.create(
        project=Project.objects.get(tenant=demo.acme, key="apollo"),
        kind="task",
        title=PRIVATE,
        status="done",
        occurred_on=timezone.localdate(),
    )
    run = demo_run(demo, project_id="apollo")
    run_execute(run_id=str(run.pk))
    action = BusinessAction.objects.get(run=run)
    handoff = handoff_open(
        run=demo_run(demo, project_id="apollo"), risks=["financial"], request="x"
    )
    memory, _ = memory_write(
        tenant=demo.acme,
        user=demo.alice,
        kind="preference",
        key="tone",
        value="Short sentences for acme-only-preference-7731",
        origin="user_stated",
    )
    suites = {suite.key: suite for suite, _ in suites_install()}
    eval_run, _ = eval_run_start(
        actor=User.objects.get(username="dave"),
        suite=suites["weekly-summary-tasks"],
        skill_version=SkillVersion.objects.get(skill__name="weekly-summary"),
        agent_config=demo.agent,
    )
    ids = {
        "run": run.pk,
        "action": action.pk,
        "handoff": handoff.pk,
        "memory": memory.pk,
        "tool": ToolVersion.objects.get(tool__name="project_search").pk,
        "skill": SkillVersion.objects.get(skill__name="weekly-summary").pk,
        "suite": suites["weekly-summary-tasks"].pk,
        "eval_run": eval_run.pk,
    }
    private = [str(ids[key]) for key in ("run", "action", "handoff", "memory", "eval_run")]
    private += [PRIVATE, "acme-only-preference-7731"]
    registry = [str(ids["tool"]), str(ids["skill"])]
    return ids, {"outside": private + registry, "member": private}, people(demo)


def people(demo) -> dict:  # noqa: F811
    """gina holds every role in globex; mallory is a plain member of acme who owns nothing."""
    User = get_user_model()
    globex = Tenant.objects.get(slug="globex")
    gina = User.objects.create_user(username="gina", password=DEMO_PASSWORD, is_staff=True)
    for role in Role:
        membership_add(actor=None, user=gina, tenant=globex, role=role)
    mallory = User.objects.create_user(username="mallory", password=DEMO_PASSWORD)
    membership_add(actor=None, user=mallory, tenant=demo.acme, role=Role.MEMBER)
    return {"globex": (gina, globex), "acme": (mallory, demo.acme)}


def _api(user, tenant) -> APIClient:
    _, key = api_token_issue(
        username=user.username, password=DEMO_PASSWORD, tenant_slug=tenant.slug
    )
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client


def _page(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _request(client, entry: Entry, ids: dict) -> tuple[int, str]:
    path = entry.path.format(**ids)
    headers = {"HTTP_IDEMPOTENCY_KEY": str(uuid.uuid4())}
    if entry.method == "post":
        response = client.post(path, {}, content_type="application/json", **headers)
    else:
        response = getattr(client, entry.method)(path, **headers)
    if getattr(response, "streaming", False):
        body = (
            b"".join(response.streaming_content).decode(errors="replace")
            if response.status_code == 200
            else ""
        )
    else:
        body = response.content.decode(errors="replace")
    return response.status_code, body


def test_outsiders_get_the_design_s_status_and_none_of_acme_s_data(world):
    """Every entry with the three outsiders; all problems are listed at once."""
    ids, secrets, people = world
    gina, globex = people["globex"]
    mallory, acme = people["acme"]
    clients = {
        "api": (APIClient(), _api(gina, globex), _api(mallory, acme)),
        "page": (Client(), _page(gina), _page(mallory)),
    }
    problems = {}
    for name, entry in sorted(ENTRIES.items()):
        is_api = entry.path.startswith("/api/")
        anonymous, other, wrong = (
            _request(client, entry, ids) for client in clients["api" if is_api else "page"]
        )
        expected = (
            ANONYMOUS_API if is_api else LOGIN_REDIRECT,
            entry.other_tenant,
            entry.wrong_role,
        )
        if (anonymous[0], other[0], wrong[0]) != expected:
            problems[name] = f"statuses {(anonymous[0], other[0], wrong[0])}, expected {expected}"
        for (status, body), markers in (
            (anonymous, secrets["outside"]),
            (other, secrets["outside"]),
            (wrong, secrets["member"]),
        ):
            leaked = [marker for marker in markers if marker in body]
            if leaked:
                problems[f"{name} ({status})"] = f"leaked {leaked}"

    assert problems == {}
