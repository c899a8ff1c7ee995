from collections.abc import Iterable
from typing import Any

from django.core.validators import RegexValidator
from django.db import models

from config.history import history_records
from registry.choices import VersionStatus
from registry.errors import VersionImmutable
from registry.models.definitions import Definition, unique_name_constraints
from registry.models.versions import DefinitionVersion
from registry.search import skill_search_fields

# What a skill version says (its lifecycle and derived search terms aside).
SKILL_CONTENT_FIELDS = (
    "description",
    "instructions",
    "triggers",
    "required_inputs",
    "rules",
    "examples",
    "output_contract",
    "acceptance_rules",
    "workflow",
)

SKILL_NAME_VALIDATOR = RegexValidator(
    r"^[a-z][a-z0-9-]{0,63}$", "Lower-case letters, digits and '-'; starts with a letter."
)


class Skill(Definition):
    """A reusable method for a class of goals: when it applies, what it needs, which tools it
    relies on, its rules and how its result is accepted."""

    name = models.CharField(max_length=64, validators=[SKILL_NAME_VALIDATOR])
    current_version = models.OneToOneField(
        "registry.SkillVersion",
        on_delete=models.PROTECT,
        related_name="+",
        null=True,
        blank=True,
        editable=False,
    )

    history = history_records()

    class Meta:
        ordering = ["namespace", "name"]
        constraints = unique_name_constraints("skill")
        permissions = [
            ("use_skill", "Can use this platform-wide skill in runs"),
            ("publish_skill", "Can publish versions of this platform-wide skill"),
        ]


class SkillVersion(DefinitionVersion):
    """One frozen method: triggers, required inputs, pinned tool versions, rules (id, scope,
    priority), examples, output contract and acceptance rules."""

    parent_field = "skill"
    derived_fields = frozenset({"search_triggers", "search_description", "search_examples"})

    skill = models.ForeignKey(Skill, on_delete=models.PROTECT, related_name="versions")
    instructions = models.TextField(blank=True, help_text="Standard operating procedure.")
    triggers = models.JSONField(default=list, blank=True)
    required_inputs = models.JSONField(default=list, blank=True)
    rules = models.JSONField(
        default=list, blank=True, help_text='[{"id", "scope", "priority", "text"}, …]'
    )
    examples = models.JSONField(default=list, blank=True)
    output_contract = models.JSONField(default=dict, blank=True)
    acceptance_rules = models.JSONField(default=list, blank=True)
    workflow = models.CharField(
        max_length=100,
        blank=True,
        help_text="name@version of the workflow (defined in code) that runs this skill; "
        "empty: the generic agent loop.",
    )
    # Search terms (registry.search) of what the skill is for, ranked in this order.
    search_triggers = models.TextField(blank=True, editable=False)
    search_description = models.TextField(blank=True, editable=False)
    search_examples = models.TextField(blank=True, editable=False)

    history = history_records(excluded_fields=sorted(derived_fields))

    class Meta:
        ordering = ["skill__name", "-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["skill", "version"], name="skillversion_unique_version"
            ),
            models.CheckConstraint(
                condition=~models.Q(status=VersionStatus.PUBLISHED)
                | models.Q(published_at__isnull=False),
                name="skillversion_published_has_date",
            ),
        ]

    def __str__(self) -> str:
        return self.qualified_name

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.is_frozen or not self.search_triggers:
            self.search_index()
        super().save(*args, **kwargs)

    def search_index(self) -> None:
        """Derive the search terms from the name, triggers, description and examples."""
        fields = skill_search_fields(
            name=self.skill.name,
            triggers=self.triggers,
            description=self.description,
            examples=self.examples,
        )
        for field, terms in fields.items():
            setattr(self, field, terms)


def _refuse_if_frozen(skill_versions: models.Q) -> None:
    frozen = (
        SkillVersion._base_manager.filter(skill_versions)
        .exclude(status=VersionStatus.DRAFT)
        .values_list("pk", flat=True)
        .first()
    )
    if frozen is not None:
        raise VersionImmutable(
            "The tool pins of a published skill version cannot change.",
            details={"skill_version": str(frozen)},
        )


class SkillToolDependencyQuerySet(models.QuerySet):
    """Refuses bulk writes to the pins of a skill version that left draft, as `save` and
    `delete` refuse them one at a time."""

    def update(self, **kwargs: Any) -> int:
        skill_versions = models.Q(tool_dependencies__in=self.values("pk"))
        target = kwargs.get("skill_version", kwargs.get("skill_version_id"))
        if target is not None:
            skill_versions |= models.Q(pk=getattr(target, "pk", target))
        _refuse_if_frozen(skill_versions)
        return super().update(**kwargs)

    def delete(self) -> tuple[int, dict[str, int]]:
        _refuse_if_frozen(models.Q(tool_dependencies__in=self.values("pk")))
        return super().delete()

    def bulk_create(self, objs: Iterable[Any], *args: Any, **kwargs: Any) -> list[Any]:
        objs = list(objs)
        _refuse_if_frozen(models.Q(pk__in=[obj.skill_version_id for obj in objs]))
        return super().bulk_create(objs, *args, **kwargs)


class SkillToolDependency(models.Model):
    """A skill version's pin of one exact tool version. Frozen with the skill version."""

    skill_version = models.ForeignKey(
        SkillVersion, on_delete=models.CASCADE, related_name="tool_dependencies"
    )
    tool_version = models.ForeignKey(
        "registry.ToolVersion", on_delete=models.PROTECT, related_name="dependent_skills"
    )

    objects = SkillToolDependencyQuerySet.as_manager()

    history = history_records()

    class Meta:
        ordering = ["tool_version__tool__name"]
        verbose_name_plural = "skill tool dependencies"
        constraints = [
            models.UniqueConstraint(
                fields=["skill_version", "tool_version"], name="skilltooldependency_unique_pin"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.skill_version} → {self.tool_version}"

    def save(self, *args, **kwargs) -> None:
        self._refuse_if_frozen()
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        self._refuse_if_frozen()
        return super().delete(*args, **kwargs)

    def _refuse_if_frozen(self) -> None:
        skill_versions = models.Q(pk=self.skill_version_id)
        if not self._state.adding:
            # A pin moved to another skill version leaves the one it was stored with.
            skill_versions |= models.Q(tool_dependencies=self.pk)
        _refuse_if_frozen(skill_versions)
