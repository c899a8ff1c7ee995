"""Fixtures of the data plane: acme's agent (offline model, a policy, the weekly-summary skill
pinning published tools), clients per user, and helpers to post messages and count rows."""

import uuid
from collections.abc import Callable
from decimal import Decimal

import pytest
from rest_framework.test import APIClient

from registry.choices import DataClassification, ModelProvider, Role
from registry.models import AgentConfig, ModelConfig, Policy, SkillVersion, ToolVersion
from registry.services import skills, tools
from registry.services.common import registry_object_save
from registry.services.tenancy import api_token_issue, membership_add
from runs.models import IngressRecord, Run, RunEvent, Session
from runs.services.ingress import message_ingest
from tests.registry.factories import PASSWORD, UserFactory

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
