import factory
from django.contrib.auth import get_user_model

from registry.choices import AdapterKind, Risk, Role
from registry.models import Membership, SkillVersion, Tenant, ToolVersion
from registry.services.tenancy import tenant_create

PASSWORD = "correct horse battery staple"


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"user{n}")
    email = factory.LazyAttribute(lambda user: f"{user.username}@example.com")
    password = factory.PostGenerationMethodCall("set_password", PASSWORD)

    @factory.post_generation
    def saved(self, create, extracted, **kwargs):
        if create:
            self.save()


class TenantFactory(factory.Factory):
    class Meta:
        model = Tenant

    slug = factory.Sequence(lambda n: f"tenant{n}")
    name = factory.LazyAttribute(lambda tenant: tenant.slug.title())

    @classmethod
    def _create(cls, model_class, slug, name):
        return tenant_create(actor=None, slug=slug, name=name)

    @classmethod
    def _build(cls, model_class, slug, name):
        return model_class(slug=slug, name=name)


class MembershipFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Membership

    user = factory.SubFactory(UserFactory)
    tenant = factory.SubFactory(TenantFactory)
    role = Role.MEMBER


def valid_input_schema() -> dict:
    return {
        "type": "object",
        "properties": {"project_id": {"type": "string"}},
        "required": ["project_id"],
        "additionalProperties": False,
    }


def tool_content(**overrides) -> dict:
    """A complete, publishable tool version's content."""
    return {
        "description": "Reads a project's status. Does not change anything.",
        "input_schema": valid_input_schema(),
        "risk": Risk.READ,
        "adapter_kind": AdapterKind.PYTHON,
        "adapter_config": {"handler": "examples.handlers.project_search"},
        **overrides,
    }


def skill_content(**overrides) -> dict:
    """A complete, publishable skill version's content."""
    return {
        "description": "Summarises a project's week.",
        "triggers": ["project weekly status"],
        "required_inputs": ["project_scope"],
        "rules": [{"id": "evidence-only", "scope": "skill", "priority": 100, "text": "Cite."}],
        "output_contract": {"sections": ["progress", "risks", "next_steps"]},
        "acceptance_rules": ["every risk has a source reference"],
        **overrides,
    }


__all__ = [
    "PASSWORD",
    "MembershipFactory",
    "SkillVersion",
    "TenantFactory",
    "ToolVersion",
    "UserFactory",
    "skill_content",
    "tool_content",
    "valid_input_schema",
]


def agent_form_data(**fields) -> dict:
    """The admin's add form of an agent, filled in as a platform admin would; `fields` (the
    tenant, model config, policy and skills at least) are the rest, or replace these."""
    return {
        "name": "reporter",
        "skill_assembly": "static",
        "skill_min_score": "0.080",
        "when_no_skill_matches": "answer",
        "max_steps": 8,
        "max_tool_calls": 16,
        "max_seconds": 300,
        "max_tokens": 60000,
        "max_cost": "1.00",
        "is_active": "on",
        **fields,
    }
