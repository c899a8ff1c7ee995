"""Evaluations in the admin, scoped like the registry: platform admins see everything, a
tenant's publishers see (and edit the suites and thresholds of) their own tenant, short of
weakening a release gate, which needs a tenant admin (`evaluations.gates`); eval runs and
overrides are measured evidence, read-only."""

from typing import Any

from django import forms
from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from evaluations import services
from evaluations.models import (
    EvalCase,
    EvalCaseResult,
    EvalRun,
    EvalSuite,
    EvalThreshold,
    ReleaseOverride,
)
from registry.admin.base import EvidenceAdmin, ReadOnlyAdminMixin, RegistryAdmin
from registry.choices import Action


class ListedCaseForm(forms.ModelForm):
    """A case as its suite's page lists it: shown, or deleted, never edited there. It is not
    checked again as a case: that check (`EvalCase.clean`) is of fields this form does not
    have, and its errors (a case deleted meanwhile, a suite changed to attack around a case
    with no vector) failed the page with a server error. The case's own page checks it."""

    def _post_clean(self) -> None:
        return


class EvalCaseInline(admin.TabularInline):
    model = EvalCase
    form = ListedCaseForm
    fields = ("key", "title", "vector")
    readonly_fields = fields
    extra = 0
    show_change_link = True

    def get_queryset(self, request: HttpRequest) -> QuerySet[EvalCase]:
        return super().get_queryset(request).select_related("suite")

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(EvalSuite)
class EvalSuiteAdmin(RegistryAdmin):
    list_display = ("key", "name", "kind", "skill_name", "tenant")
    list_select_related = ("tenant",)
    list_filter = ("kind", "tenant")
    search_fields = ("key", "name", "skill_name")
    inlines = (EvalCaseInline,)

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        services.eval_suite_save(suite=obj, actor=request.user, reason="saved in admin")

    def save_formset(self, request: HttpRequest, form: Any, formset: Any, change: bool) -> None:
        """The page only lists cases: one ticked for deletion is deleted as on its own page."""
        formset.save(commit=False)
        for case in formset.deleted_objects:
            services.eval_case_delete(case=case, actor=request.user, reason="deleted in admin")


@admin.register(EvalCase)
class EvalCaseAdmin(RegistryAdmin):
    tenant_lookup = "suite__tenant"
    list_display = ("key", "suite", "title", "vector")
    list_filter = ("suite", "vector")
    search_fields = ("key", "title", "payload")
    list_select_related = ("suite",)

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        services.eval_case_save(case=obj, actor=request.user, reason="saved in admin")

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        services.eval_case_delete(case=obj, actor=request.user, reason="deleted in admin")

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet) -> None:
        for case in queryset:
            services.eval_case_delete(case=case, actor=request.user, reason="deleted in admin")


@admin.register(EvalThreshold)
class EvalThresholdAdmin(RegistryAdmin):
    list_display = ("skill_name", "suite", "metric", "comparator", "value", "tenant")
    list_filter = ("tenant", "suite", "metric")
    search_fields = ("skill_name",)
    list_select_related = ("suite", "tenant")

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        services.eval_threshold_save(threshold=obj, actor=request.user, reason="saved in admin")


class MeasuredAdmin:
    """Measured results are shown to those who may see the tenant's drafts."""

    required_action = Action.REGISTRY_VIEW_UNPUBLISHED


class EvalCaseResultInline(admin.TabularInline):
    model = EvalCaseResult
    fields = ("case", "passed", "failures", "run")
    readonly_fields = fields
    extra = 0

    def get_queryset(self, request: HttpRequest) -> QuerySet[EvalCaseResult]:
        return super().get_queryset(request).select_related("case__suite")

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(EvalRun)
class EvalRunAdmin(MeasuredAdmin, ReadOnlyAdminMixin, RegistryAdmin):
    list_display = (
        "id",
        "suite",
        "skill_version",
        "model_config",
        "status",
        "cases_done",
        "cases_total",
        "created_at",
    )
    list_filter = ("status", "suite", "tenant")
    list_select_related = ("suite", "skill_version__skill", "model_config")
    inlines = (EvalCaseResultInline,)


@admin.register(ReleaseOverride)
class ReleaseOverrideAdmin(MeasuredAdmin, EvidenceAdmin):
    tenant_lookup = "skill_version__skill__tenant"
    list_display = ("skill_version", "actor", "reason", "created_at")
    list_select_related = ("skill_version__skill", "actor")
    search_fields = ("reason", "skill_version__skill__name")
