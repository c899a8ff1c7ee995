"""The running example's registry content: tenants, people, tools, skill, agent, policy.

Loading is idempotent: what exists is left as it is, what is missing is created and published.
"""

import sys
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import yaml
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from examples.demo import seed_examples
from registry.choices import DataClassification, ModelProvider, Risk, Role, VersionStatus
from registry.models import (
    AgentConfig,
    McpServer,
    ModelConfig,
    Policy,
    SkillVersion,
    Tenant,
    ToolVersion,
)
from registry.selectors import tool_version_resolve
from registry.services import skills, tools
from registry.services.common import registry_object_save
from registry.services.tenancy import membership_add, tenant_create

DATA = Path(__file__).parent / "demo_data"
# The published password of the local demo users; never used outside `seed_demo`.
DEMO_PASSWORD = "agents-demo"

# username, tenant, roles, is_staff
PEOPLE: list[tuple[str, str, tuple[Role, ...], bool]] = [
    ("alice", "acme", (Role.MEMBER,), False),
    ("bob", "acme", (Role.APPROVER,), False),
    ("carol", "acme", (Role.AUDITOR,), False),
    ("dave", "acme", (Role.PUBLISHER,), True),
    ("erin", "globex", (Role.MEMBER,), False),
]
ADMIN_USERNAME = "admin"


@dataclass
class SeedReport:
    created: list[str] = field(default_factory=list)

    def add(self, what: str) -> None:
        self.created.append(what)


def _user(username: str, *, is_staff: bool, is_superuser: bool, report: SeedReport):
    User = get_user_model()
    user = User.objects.filter(username=username).first()
    if user is None:
        user = User(
            username=username,
            email=f"{username}@example.com",
            is_staff=is_staff,
            is_superuser=is_superuser,
        )
        user.set_password(DEMO_PASSWORD)
        user.save()
        report.add(f"user {username}")
    return user


def _tenant(slug: str, name: str, actor: AbstractBaseUser, report: SeedReport) -> Tenant:
    tenant = Tenant.objects.filter(slug=slug).first()
    if tenant is None:
        tenant = tenant_create(actor=actor, slug=slug, name=name)
        report.add(f"tenant {slug}")
    return tenant


def _tool(spec: dict, tenant: Tenant, actor: AbstractBaseUser, report: SeedReport) -> None:
    existing = ToolVersion.objects.filter(
        tool__tenant=tenant, tool__name=spec["name"], version=spec["version"]
    ).first()
    if existing is None:
        existing = tools.tool_version_create(actor=actor, tenant=tenant, **spec)
        report.add(f"tool {existing.qualified_name}")
    if existing.status == VersionStatus.DRAFT:
        tools.tool_version_publish(tool_version=existing, actor=actor)


def _skill(spec: dict, tenant: Tenant, actor: AbstractBaseUser, report: SeedReport):
    spec = dict(spec)
    references = spec.pop("depends_on_tools")
    existing = SkillVersion.objects.filter(
        skill__tenant=tenant, skill__name=spec["name"], version=spec["version"]
    ).first()
    if existing is None:
        pinned = [tool_version_resolve(tenant=tenant, reference=ref) for ref in references]
        existing = skills.skill_version_create(
            actor=actor, tenant=tenant, tool_versions=pinned, **spec
        )
        report.add(f"skill {existing.qualified_name}")
    if existing.status == VersionStatus.DRAFT:
        skills.skill_version_publish(skill_version=existing, actor=actor)
    return existing.skill


def _config(model, lookup: dict, values: dict, actor: AbstractBaseUser, report: SeedReport):
    instance = model.objects.filter(**lookup).first()
    if instance is None:
        instance = model(**lookup, **values)
        registry_object_save(instance=instance, actor=actor, reason="demo seeded")
        report.add(f"{model._meta.verbose_name} {lookup.get('name')}")
    return instance


@transaction.atomic
def seed_demo() -> SeedReport:
    report = SeedReport()
    admin = _user(ADMIN_USERNAME, is_staff=True, is_superuser=True, report=report)
    acme = _tenant("acme", "Acme Corporation", admin, report)
    globex = _tenant("globex", "Globex Inc.", admin, report)
    membership_add(actor=admin, user=admin, tenant=acme, role=Role.ADMIN)
    tenants = {"acme": acme, "globex": globex}
    for username, tenant_slug, roles, is_staff in PEOPLE:
        user = _user(username, is_staff=is_staff, is_superuser=False, report=report)
        for role in roles:
            membership_add(actor=admin, user=user, tenant=tenants[tenant_slug], role=role)

    for spec in yaml.safe_load((DATA / "tools.yaml").read_text()):
        _tool(spec, acme, admin, report)
    skill_spec = yaml.safe_load((DATA / "weekly-summary.yaml").read_text())
    weekly_summary = _skill(skill_spec, acme, admin, report)

    model = _config(
        ModelConfig,
        {"tenant": None, "name": "offline-planner"},
        {
            "provider": ModelProvider.OFFLINE,
            "model_name": "offline-deterministic-planner",
            "price_per_1k_input": Decimal("0"),
            "price_per_1k_output": Decimal("0"),
        },
        admin,
        report,
    )
    policy = _config(
        Policy,
        {"tenant": acme, "name": "approval-before-side-effects"},
        {
            "approval_required_risks": [
                Risk.EXTERNAL_SIDE_EFFECT,
                Risk.DESTRUCTIVE,
                Risk.FINANCIAL,
            ],
            "approver_roles": [Role.APPROVER],
            "allow_self_approval": False,
            "approval_ttl_seconds": 24 * 3600,
            "max_data_classification": DataClassification.CONFIDENTIAL,
        },
        admin,
        report,
    )
    agent = _config(
        AgentConfig,
        {"tenant": acme, "name": "weekly-reporter"},
        {
            "description": "Summarises a project's week and mails it after approval.",
            "model_config": model,
            "policy": policy,
            "max_steps": 8,
            "max_tool_calls": 12,
            "max_seconds": 300,
            "max_tokens": 60_000,
            "max_cost": Decimal("0.50"),
        },
        admin,
        report,
    )
    if not agent.skills.filter(pk=weekly_summary.pk).exists():
        agent.skills.add(weekly_summary)
    _config(
        McpServer,
        {"tenant": acme, "name": "projects"},
        {
            "description": "The running example's project data (examples/mcp_server.py).",
            "transport": McpServer.Transport.STDIO,
            "command": sys.executable,
            "args": ["-m", "examples.mcp_server"],
            "created_by": admin,
        },
        admin,
        report,
    )
    _config(
        ModelConfig,
        {"tenant": None, "name": "adversarial-planner"},
        {
            "provider": ModelProvider.ADVERSARIAL,
            "model_name": "adversarial-planner",
            "price_per_1k_input": Decimal("0"),
            "price_per_1k_output": Decimal("0"),
        },
        admin,
        report,
    )
    for what in seed_examples():
        report.add(what)
    return report
