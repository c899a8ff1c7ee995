"""Fixtures of the data plane: acme's agent (offline model, a policy, the weekly-summary skill
pinning published tools), clients per user, and helpers to post messages and count rows."""

import io
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from examples.models import DirectoryRecord, ProjectUpdate
from registry.choices import DataClassification, ModelProvider, Role
from registry.models import AgentConfig, ModelConfig, Policy, SkillVersion, Tenant, ToolVersion
from registry.services import skills, tools
from registry.services.common import registry_object_save
from registry.services.tenancy import api_token_issue, membership_add
from runs.loop import (
    RECIPIENT_ROLE,
    ModelTemporarilyUnavailable,
    run_advance_step,
    run_execute,
)
from runs.model_clients.offline import OfflinePlanner
from runs.models import IngressRecord, Run, RunEvent, Session
from runs.services.ingress import message_ingest
from tests.registry.factories import PASSWORD, UserFactory
from tests.runs.fake_provider import API_KEY as FAKE_API_KEY
from tests.runs.fake_provider import CREDENTIAL_REF as FAKE_CREDENTIAL_REF
from tests.runs.fake_provider import FakeProvider, openai_completion, serving

MESSAGES = "/api/v1/messages"
RUNS = "/api/v1/runs"

DIRECTORY_LOOKUP_SCHEMA = {
    "type": "object",
    "properties": {"project_id": {"type": "string"}, "role": {"type": "string"}},
    "required": ["project_id", "role"],
    "additionalProperties": False,
}


def message_body(
    text: str = "Summarise project Apollo's week and mail it to the R&D lead.", **extra
):
    """A valid POST /api/v1/messages body."""
    return {"channel": "api", "parts": [{"type": "text", "text": text}], **extra}


def row_counts() -> dict[str, int]:
    """How many rows the data plane holds, to prove a refused request left nothing behind."""
    return {
        "runs": Run.objects.count(),
        "events": RunEvent.objects.count(),
        "sessions": Session.objects.count(),
        "ingress_records": IngressRecord.objects.count(),
    }


NOTHING = {"runs": 0, "events": 0, "sessions": 0, "ingress_records": 0}


def event_log(run) -> list[tuple[int, str]]:
    return list(RunEvent.objects.filter(run=run).order_by("seq").values_list("seq", "type"))


@pytest.fixture
def add_member(acme):
    """A new user holding `roles` in `tenant` (acme by default)."""

    def add(username: str, *roles: Role, tenant=None):
        user = UserFactory(username=username)
        for role in roles:
            membership_add(actor=None, user=user, tenant=tenant or acme, role=role)
        return user

    return add


@pytest.fixture
def client_for(db) -> Callable[..., APIClient]:
    """A fresh API client authenticated as `user` in `tenant` (one client per call)."""

    def make(user, tenant=None) -> APIClient:
        _, key = api_token_issue(
            username=user.username, password=PASSWORD, tenant_slug=tenant.slug if tenant else None
        )
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
        return client

    return make


@pytest.fixture
def post_message():
    """POST a message with an Idempotency-Key (a fresh one unless given)."""

    def post(client: APIClient, body: dict | None = None, *, key: str | None = None):
        return client.post(
            MESSAGES,
            message_body() if body is None else body,
            format="json",
            HTTP_IDEMPOTENCY_KEY=key or f"key-{uuid.uuid4()}",
        )

    return post


@pytest.fixture
def publish_tool(make_tool_version, publisher) -> Callable[..., ToolVersion]:
    """Create and publish an acme tool version (or a platform one with actor/tenant given)."""

    def publish(name: str, version: str = "1.0.0", **overrides) -> ToolVersion:
        actor = overrides.get("actor", publisher)
        draft = make_tool_version(name=name, version=version, **overrides)
        return tools.tool_version_publish(tool_version=draft, actor=actor)

    return publish


@pytest.fixture
def publish_skill(make_skill_version, publisher) -> Callable[..., SkillVersion]:
    def publish(name: str = "weekly-summary", version: str = "1.0.0", **overrides):
        draft = make_skill_version(name=name, version=version, **overrides)
        return skills.skill_version_publish(skill_version=draft, actor=publisher)

    return publish


@pytest.fixture
def acme_tools(publish_tool) -> dict[str, ToolVersion]:
    """The running example's two read tools, published by acme."""
    return {
        "project_search": publish_tool("project_search", "2.0.0"),
        "directory_lookup": publish_tool(
            "directory_lookup",
            "1.0.0",
            input_schema=DIRECTORY_LOOKUP_SCHEMA,
            risk="read_sensitive",
            data_classification=DataClassification.CONFIDENTIAL,
            adapter_config={"handler": "examples.handlers.directory_lookup"},
        ),
    }


@pytest.fixture
def acme_skill(publish_skill, acme_tools) -> SkillVersion:
    """weekly-summary 1.0.0, published, pinning both read tools."""
    return publish_skill(tool_versions=list(acme_tools.values()))


@pytest.fixture
def offline_model(publisher) -> ModelConfig:
    return registry_object_save(
        instance=ModelConfig(
            tenant=None,
            name="offline-planner",
            provider=ModelProvider.OFFLINE,
            model_name="offline-deterministic-planner",
        ),
        actor=publisher,
    )


@pytest.fixture
def acme_policy(acme, publisher) -> Policy:
    return registry_object_save(
        instance=Policy(
            tenant=acme,
            name="approval-before-side-effects",
            max_data_classification=DataClassification.CONFIDENTIAL,
        ),
        actor=publisher,
    )


@pytest.fixture
def acme_agent(acme, publisher, offline_model, acme_policy, acme_skill) -> AgentConfig:
    """acme's active agent: the offline model, the policy, weekly-summary statically bound."""
    agent = registry_object_save(
        instance=AgentConfig(
            tenant=acme,
            name="weekly-reporter",
            model_config=offline_model,
            policy=acme_policy,
            max_steps=8,
            max_tool_calls=12,
            max_seconds=300,
            max_tokens=60_000,
            max_cost=Decimal("0.50"),
        ),
        actor=publisher,
    )
    agent.skills.add(acme_skill.skill)
    return agent


@pytest.fixture
def alice(member, acme, client_for, acme_agent) -> APIClient:
    """alice (member of acme) with a token acting in acme, where weekly-reporter is active."""
    return client_for(member, acme)


@pytest.fixture
def start_run(acme):
    """Start a run through the ingress service, as the API would; returns the Run."""

    def start(user, tenant=None, *, text: str = "Summarise project Apollo's week.", **kwargs):
        return message_ingest(
            actor=user,
            tenant=tenant or acme,
            idempotency_key=kwargs.pop("idempotency_key", f"key-{uuid.uuid4()}"),
            channel=kwargs.pop("channel", "api"),
            parts=[{"type": "text", "text": text}],
            metadata=kwargs.pop("metadata", {}),
            **kwargs,
        ).run

    return start


# --- the loop: the seeded running example and a fake model provider -----------------------
# (used by test_loop.py and test_gates.py)

RUNNING_EXAMPLE_TEXT = "汇总本周项目状态，并发给研发负责人"  # noqa: RUF001 (seed 000)


@dataclass
class Demo:
    """What `seed_demo` created, as the loop tests use it."""

    admin: Any
    alice: Any
    acme: Any
    globex: Any
    agent: AgentConfig


@pytest.fixture
def demo(demo_database, db) -> Demo:
    """The running example exactly as `manage.py seed_demo` loads it: in the seeded copy of
    the test database (`demo_database`) or seeded here."""
    if demo_database is None or connection.settings_dict["NAME"] != demo_database.name:
        call_command("seed_demo", stdout=io.StringIO())
    return demo_found()


def demo_found() -> Demo:
    """The running example's people, tenants and agent, once seeded."""
    users = get_user_model().objects
    return Demo(
        admin=users.get(username="admin"),
        alice=users.get(username="alice"),
        acme=Tenant.objects.get(slug="acme"),
        globex=Tenant.objects.get(slug="globex"),
        agent=AgentConfig.objects.get(tenant__slug="acme", name="weekly-reporter"),
    )


def demo_run(
    demo: Demo, *, text: str = RUNNING_EXAMPLE_TEXT, actor=None, session_id=None, **metadata
) -> Run:
    """A message to acme as alice (or `actor`), in a new session or `session_id`, through the
    ingress service; the run is QUEUED (its task is enqueued only on commit, which the `db`
    fixture never reaches)."""
    return message_ingest(
        actor=actor or demo.alice,
        tenant=demo.acme,
        idempotency_key=f"key-{uuid.uuid4()}",
        channel="chat",
        parts=[{"type": "text", "text": text}],
        metadata=metadata,
        session_id=session_id,
    ).run


@dataclass
class HeldPlanner:
    """The offline planner, each question held until the test lets it go: `asked` is set
    when it is asked; `let_go` releases it; `requests` are what it was asked and `in_time`
    whether each was let go within 20 s."""

    asked: threading.Event = field(default_factory=threading.Event)
    let_go: threading.Event = field(default_factory=threading.Event)
    requests: list = field(default_factory=list)
    in_time: list[bool] = field(default_factory=list)

    @contextmanager
    def passing(self) -> Iterator[None]:
        """Questions asked inside are answered at once, then forgotten: the steps before
        the one a test holds."""
        self.let_go.set()
        try:
            yield
        finally:
            self.let_go.clear()
            self.asked.clear()
            self.requests.clear()
            self.in_time.clear()


@pytest.fixture
def held_planner(monkeypatch) -> HeldPlanner:
    held = HeldPlanner()
    complete = OfflinePlanner.complete

    def held_complete(self, request):
        held.requests.append(request)
        held.asked.set()
        held.in_time.append(held.let_go.wait(timeout=20))
        return complete(self, request)

    monkeypatch.setattr(OfflinePlanner, "complete", held_complete)
    return held


@pytest.fixture
def planner_requests(monkeypatch) -> list:
    """What the offline planner is asked, each request in turn, as it answers them."""
    requests = []
    complete = OfflinePlanner.complete

    def recorded(self, request):
        requests.append(request)
        return complete(self, request)

    monkeypatch.setattr(OfflinePlanner, "complete", recorded)
    return requests


def step_in_thread(run) -> threading.Thread:
    """The run's next step, started on a thread of its own (with its own connection)."""

    def step() -> None:
        try:
            run_advance_step(run_id=str(run.pk))
        finally:
            connection.close()

    stepping = threading.Thread(target=step)
    stepping.start()
    return stepping


def event_types(run) -> list[str]:
    return list(RunEvent.objects.filter(run=run).order_by("seq").values_list("type", flat=True))


def events_of(run, event_type: str) -> list[dict]:
    return list(
        RunEvent.objects.filter(run=run, type=event_type)
        .order_by("seq")
        .values_list("payload", flat=True)
    )


def this_week() -> tuple[str, str]:
    """Monday and Sunday of the current week, as the running example reads it."""
    today = timezone.localdate()
    monday = today - timedelta(days=today.weekday())
    return monday.isoformat(), (monday + timedelta(days=6)).isoformat()


def update_reference(project_key: str, title: str) -> str:
    """The source reference project_search gives the seeded update with this title."""
    update = ProjectUpdate.objects.get(project__key=project_key, title=title)
    return f"project:{project_key}/update:{update.pk}"


@pytest.fixture
def model_server() -> Iterator[FakeProvider]:
    """A local fake model provider over real HTTP (tests/runs/fake_provider.py)."""
    with serving() as provider:
        yield provider


@pytest.fixture
def fake_model(demo, model_server, monkeypatch) -> Callable[..., FakeProvider]:
    """Point acme's weekly-reporter at the fake provider (OpenAI-compatible by default, or
    Anthropic Messages); the API key comes from an environment variable, as in production."""

    def use(provider: str = ModelProvider.OPENAI_COMPATIBLE) -> FakeProvider:
        monkeypatch.setenv(FAKE_CREDENTIAL_REF, FAKE_API_KEY)
        is_openai = provider == ModelProvider.OPENAI_COMPATIBLE
        config = registry_object_save(
            instance=ModelConfig(
                tenant=None,
                name=f"fake-{'openai' if is_openai else 'anthropic'}",
                provider=provider,
                model_name="fake-gpt" if is_openai else "fake-claude",
                base_url=f"http://127.0.0.1:{model_server.port}" + ("/v1" if is_openai else ""),
                credential_ref=FAKE_CREDENTIAL_REF,
            ),
            actor=demo.admin,
        )
        demo.agent.model_config = config
        registry_object_save(instance=demo.agent, actor=demo.admin, reason="fake model")
        return model_server

    return use


def weekly_summary_executed(run, *, redelivered: bool) -> None:
    """Execute the run at once, or, `redelivered`, with the provider unavailable for its
    first turn (its next answer queued after an error, `provider_unavailable_once`): its start
    by an execution that saves it alone and ends there, and the rest by the task's retry,
    another execution; then it is a weekly summary waiting for its approval."""
    if redelivered:
        with pytest.raises(ModelTemporarilyUnavailable):
            run_execute(run_id=str(run.pk))
        assert Run.objects.get(pk=run.pk).status == "RUNNING"
    run_execute(run_id=str(run.pk))
    run.refresh_from_db()
    assert run.skill.startswith("weekly-summary")
    assert run.status == "WAITING_APPROVAL", run.result


def provider_unavailable_once(fake) -> None:
    """The fake provider's next answer: overloaded (503), which the run's task retries."""
    fake.reply({"error": {"message": "overloaded"}}, status=503)


def recipient_confirmed(session_id) -> None:
    """The session holds apollo's R&D lead as a recipient its user confirmed an hour ago: a
    weekly summary in it starts without looking the lead up."""
    lead = DirectoryRecord.objects.get(project__key="apollo", role=RECIPIENT_ROLE)
    Session.objects.filter(pk=session_id).update(
        state={
            "recipient": {
                "project_id": "apollo",
                "role": RECIPIENT_ROLE,
                "snapshot": {
                    "record_id": lead.record_id,
                    "display_name": lead.display_name,
                    "corporate_email": lead.corporate_email,
                    "record_version": lead.version,
                },
                "expires_at": (timezone.now() + timedelta(hours=1)).isoformat(),
            }
        }
    )


def apollo_draft(**overrides: Any) -> dict:
    """A draft a real model could write from apollo's week, citing project_search's sources."""
    return {
        "subject": "Weekly status: Project Apollo",
        "progress": [
            {
                "text": "API gateway migration done",
                "source": update_reference("apollo", "API gateway migration"),
            }
        ],
        "risks": [
            {
                "text": "Vendor SDK delay",
                "source": update_reference("apollo", "Vendor SDK delay"),
            }
        ],
        "next_steps": [
            {"text": "Load test plan", "source": update_reference("apollo", "Load test plan")}
        ],
        "body": "Progress, risks and next steps of Project Apollo.",
        **overrides,
    }


def read_apollo(call_id: str = "call_read", *, project_id: str = "apollo") -> dict:
    """A model's turn that reads this week of a project (apollo unless told)."""
    monday, sunday = this_week()
    arguments = json.dumps({"project_id": project_id, "from": monday, "to": sunday})
    return openai_completion(tool_calls=((call_id, "project_search", arguments),))
