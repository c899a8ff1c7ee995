from typing import Any

from django import forms
from django.contrib import admin
from django.db import models
from django.db.models import Q, QuerySet
from django.http import HttpRequest

from evaluations.errors import ReleaseGateFailed
from evaluations.gates import model_change_check
from registry.admin.base import RegistryAdmin
from registry.choices import Action
from registry.errors import ValidationFailed
from registry.models import AgentConfig, ModelConfig, Policy, RolloutFlag, Skill
from registry.selectors import definitions_visible
from registry.services.common import agent_skills_check, registry_object_save


class ConfigAdmin(RegistryAdmin):
    required_action = Action.TENANT_ADMIN

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        registry_object_save(instance=obj, actor=request.user, reason="saved in admin")


@admin.register(ModelConfig)
class ModelConfigAdmin(ConfigAdmin):
    list_display = (
        "name",
        "tenant",
        "provider",
        "model_name",
        "price_per_1k_input",
        "price_per_1k_output",
        "is_active",
    )
    list_filter = ("provider", "is_active", "tenant")
    search_fields = ("name", "model_name")
    list_select_related = ("tenant",)
    formfield_overrides = {models.URLField: {"assume_scheme": "https"}}


class AgentConfigForm(forms.ModelForm):
    """A skill the agent's tenant may not use is an error of the skills field; a move to another
    model that the release gates of the agent's skills, as submitted with it, refuse is an error
    of the model field, skills it is given with no move that theirs refuse (a change to recall
    its skills, skills bound, the agent resumed) of the field that gave them; all shown with
    what was typed.

    Once the agent's tenant is known (an agent's page, a form drawn again), the skills offered
    are those the tenant may use, and those chosen: a skill chosen that the tenant may not use
    stays in view with its error, and is still refused by the check, with its reason."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.is_bound and self.instance.tenant_id is not None:
            self._offer_skills(self.instance.skills.all())

    def _offer_skills(self, chosen: QuerySet[Skill]) -> None:
        field = self.fields.get("skills")
        if field is None:
            return
        usable = definitions_visible(model=Skill, tenant=self.instance.tenant)
        field.queryset = field.queryset.filter(
            Q(pk__in=usable.values("pk")) | Q(pk__in=chosen.values("pk"))
        )

    def _post_clean(self) -> None:
        super()._post_clean()
        if self.instance.tenant_id is not None:
            self._offer_skills(self.cleaned_data.get("skills", Skill.objects.none()))
        if self.errors:
            return
        try:
            agent_skills_check(agent_config=self.instance, skills=self.cleaned_data["skills"])
        except ValidationFailed as refused:
            self.add_error("skills", refused.details["skills"])
            return
        try:
            model_change_check(
                agent_config=self.instance, bound_skills=self.cleaned_data.get("skills")
            )
        except ReleaseGateFailed as refused:
            field = next(
                (
                    name
                    for name in ("model_config", "skill_assembly", "is_active")
                    if name in self.changed_data or self.instance._state.adding
                ),
                "skills",
            )
            self.add_error(field, refused.message)


@admin.register(AgentConfig)
class AgentConfigAdmin(ConfigAdmin):
    form = AgentConfigForm
    list_display = (
        "name",
        "tenant",
        "model_config",
        "policy",
        "skill_assembly",
        "max_steps",
        "max_cost",
        "is_active",
    )
    list_filter = ("tenant", "skill_assembly", "is_active")
    search_fields = ("name", "description")
    list_select_related = ("tenant", "model_config", "policy__tenant")
    filter_horizontal = ("skills",)

    def save_model(
        self, request: HttpRequest, obj: AgentConfig, form: AgentConfigForm, change: bool
    ) -> None:
        registry_object_save(
            instance=obj,
            actor=request.user,
            reason="saved in admin",
            skills=form.cleaned_data.get("skills"),
        )


@admin.register(Policy)
class PolicyAdmin(ConfigAdmin):
    list_display = (
        "name",
        "tenant",
        "allow_self_approval",
        "approval_ttl_seconds",
        "max_data_classification",
    )
    list_filter = ("tenant", "allow_self_approval", "max_data_classification")
    search_fields = ("name",)
    list_select_related = ("tenant",)


@admin.register(RolloutFlag)
class RolloutFlagAdmin(ConfigAdmin):
    tenant_lookup = "skill__tenant"
    list_display = ("key", "skill", "skill_version", "percentage", "is_active")
    list_filter = ("is_active",)
    search_fields = ("key", "skill__name")
    list_select_related = ("skill__tenant", "skill_version__skill")
    filter_horizontal = ("tenants",)

    def save_model(
        self, request: HttpRequest, obj: RolloutFlag, form: forms.ModelForm, change: bool
    ) -> None:
        """The release gate holds for the flag as submitted, with the tenants it lists."""
        registry_object_save(
            instance=obj,
            actor=request.user,
            reason="saved in admin",
            tenants=form.cleaned_data.get("tenants"),
        )
