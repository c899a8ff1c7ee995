"""Reads of evaluations with the tenant scope applied in one place: eval runs, results and
tenant suites are seen by those who may see a tenant's unpublished versions (publishers,
auditors, admins); platform suites by everyone who may view the registry."""

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Count, Q, QuerySet

from evaluations.models import EvalRun, EvalSuite
from registry.choices import Action
from registry.models import Tenant
from registry.selectors import tenants_where_user_can


def _tenants(user: AbstractBaseUser, tenant: Tenant | None) -> QuerySet[Tenant]:
    tenants = tenants_where_user_can(user=user, action=Action.REGISTRY_VIEW_UNPUBLISHED)
    return tenants.filter(pk=tenant.pk) if tenant is not None else tenants


def eval_runs_visible(*, user: AbstractBaseUser, tenant: Tenant | None = None) -> QuerySet[EvalRun]:
    return (
        EvalRun.objects.filter(tenant__in=_tenants(user, tenant))
        .select_related(
            "tenant",
            "suite",
            "skill_version__skill",
            "model_config",
            "agent_config",
            "created_by",
        )
        .order_by("-created_at", "-pk")
    )


def eval_suites_visible(
    *, user: AbstractBaseUser, tenant: Tenant | None = None
) -> QuerySet[EvalSuite]:
    if not _tenants(user, tenant).exists():
        return EvalSuite.objects.none()
    return (
        EvalSuite.objects.filter(Q(tenant__isnull=True) | Q(tenant__in=_tenants(user, tenant)))
        .select_related("tenant")
        .annotate(case_count=Count("cases"))
        .order_by("key", "pk")
    )
