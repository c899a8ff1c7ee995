from typing import Any

from django.core.validators import RegexValidator
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from config.api import (
    DocumentField,
    StrictBooleanField,
    StrictCharField,
    StrictIntegerField,
    StrictSerializer,
    StrictSlugField,
)
from registry.choices import AdapterKind, ApprovalRule, DataClassification, Risk
from registry.models import SkillVersion, ToolVersion
from registry.models.definitions import NAMESPACE_VALIDATOR
from registry.models.skills import SKILL_NAME_VALIDATOR
from registry.models.tools import TOOL_NAME_VALIDATOR
from registry.models.versions import SEMVER_PATTERN, validate_semver
from registry.schemas import (
    ACCEPTANCE_RULES_SCHEMA,
    ADAPTER_CONFIG_SCHEMAS,
    CIRCUIT_BREAKER_SCHEMA,
    EXAMPLES_SCHEMA,
    OUTPUT_CONTRACT_SCHEMA,
    RATE_LIMIT_SCHEMA,
    REQUIRED_INPUTS_SCHEMA,
    RESULT_CONTRACT_SCHEMA,
    RETRY_POLICY_SCHEMA,
    SKILL_RULES_SCHEMA,
    TRIGGERS_SCHEMA,
)
from registry.selectors import mcp_drift
from registry.services.skills import SKILL_CONTENT_FIELDS
from registry.services.tools import TOOL_CONTENT_FIELDS
from runs.workflows import WORKFLOWS

# A pinned tool: its name, in a namespace when it says so, and its major version,
# major.minor, or a whole version.
TOOL_REFERENCE_VALIDATOR = RegexValidator(
    r"^(?:[a-z][a-z0-9_.-]{0,62}/)?[a-z][a-z0-9_]{0,63}@(?:(0|[1-9][0-9]*)(\.(0|[1-9][0-9]*))?|"
    + SEMVER_PATTERN.removeprefix("^").removesuffix("$")
    + r")\Z",
    'A pinned tool is written "name@version" or "namespace/name@version": '
    "project_search@2, @2.1 or @2.1.0.",
)


# A skill is one method with the few tools it needs; each pin is looked up on its own.
MAX_TOOL_DEPENDENCIES = 32


class TokenRequestSerializer(StrictSerializer):
    username = StrictCharField(max_length=150)
    password = StrictCharField(max_length=256, trim_whitespace=False)
    tenant = StrictSlugField(required=False, help_text="Needed if you are in several.")


class TokenSerializer(serializers.Serializer):
    token = serializers.CharField()
    tenant = serializers.CharField()
    expires_at = serializers.DateTimeField()


class DefinitionRefSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    namespace = serializers.CharField()
    tenant = serializers.CharField(
        source="tenant.slug", read_only=True, allow_null=True, help_text="Empty: platform-wide."
    )


class VersionFieldsSerializer(serializers.ModelSerializer):
    qualified_name = serializers.CharField(read_only=True)
    is_current = serializers.BooleanField(read_only=True)
    published_by = serializers.SlugRelatedField(
        slug_field="username", read_only=True, allow_null=True
    )

    version_fields = [
        "id",
        "version",
        "qualified_name",
        "status",
        "status_reason",
        "is_current",
        "created_at",
        "published_at",
        "published_by",
        "deprecated_at",
        "revoked_at",
    ]


class ToolVersionListSerializer(serializers.ListSerializer):
    """Reads the drift of every MCP tool version of the page in one query."""

    def to_representation(self, data: Any) -> list[dict[str, Any]]:
        items = list(data.all() if hasattr(data, "all") else data)
        self.child.drift = mcp_drift(items)
        return super().to_representation(items)


class ToolVersionSerializer(VersionFieldsSerializer):
    tool = DefinitionRefSerializer(read_only=True)
    drift = serializers.SerializerMethodField(
        help_text="MCP tools only: DEFINITION_CHANGED, REMOVED or LISTED_AMBIGUOUSLY (listed "
        "more than once with different definitions) when the server no longer serves the "
        "reviewed definition (calls are blocked until a new version is reviewed)."
    )

    class Meta:
        model = ToolVersion
        fields = [
            *VersionFieldsSerializer.version_fields,
            "tool",
            "drift",
            *TOOL_CONTENT_FIELDS,
        ]
        read_only_fields = fields
        list_serializer_class = ToolVersionListSerializer

    @extend_schema_field(
        serializers.ChoiceField(
            choices=["DEFINITION_CHANGED", "REMOVED", "LISTED_AMBIGUOUSLY"], allow_null=True
        )
    )
    def get_drift(self, tool_version: ToolVersion) -> str | None:
        drift = getattr(self, "drift", None)
        if drift is None:
            drift = mcp_drift([tool_version])
        return drift.get(str(tool_version.pk))


@extend_schema_field({"type": "string", "pattern": SEMVER_PATTERN, "maxLength": 64})
class SemverField(StrictCharField):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_length=64, validators=[validate_semver], **kwargs)


def namespace_field() -> StrictCharField:
    return StrictCharField(max_length=63, default="core", validators=[NAMESPACE_VALIDATOR])


class ToolVersionCreateSerializer(StrictSerializer):
    name = StrictCharField(max_length=64, validators=[TOOL_NAME_VALIDATOR])
    namespace = namespace_field()
    version = SemverField()
    description = StrictCharField()
    when_not_to_use = StrictCharField(required=False, allow_blank=True)
    returns = StrictCharField(required=False, allow_blank=True)
    input_schema = DocumentField(
        document_schema={
            "type": "object",
            "properties": {
                "type": {"enum": ["object"]},
                "additionalProperties": {"enum": [False]},
                "properties": {"type": "object"},
            },
            "required": ["type", "additionalProperties"],
        },
        help_text='A JSON Schema (Draft 2020-12) with "type": "object" and '
        '"additionalProperties": false, whose references ($ref) lead to parts of itself, '
        "never in a loop.",
    )
    result_contract = DocumentField(document_schema=RESULT_CONTRACT_SCHEMA, required=False)
    risk = serializers.ChoiceField(choices=Risk.choices)
    timeout_s = StrictIntegerField(required=False, min_value=1, max_value=600)
    retry_policy = DocumentField(document_schema=RETRY_POLICY_SCHEMA, required=False)
    rate_limit = DocumentField(document_schema=RATE_LIMIT_SCHEMA, required=False)
    concurrency_cap = StrictIntegerField(required=False, min_value=1, max_value=256)
    circuit_breaker = DocumentField(document_schema=CIRCUIT_BREAKER_SCHEMA, required=False)
    is_idempotent = StrictBooleanField(required=False)
    supports_dry_run = StrictBooleanField(required=False)
    approval_rule = serializers.ChoiceField(choices=ApprovalRule.choices, required=False)
    data_classification = serializers.ChoiceField(
        choices=DataClassification.choices, required=False
    )
    adapter_kind = serializers.ChoiceField(choices=AdapterKind.choices)
    adapter_config = DocumentField(
        document_schema={"oneOf": list(ADAPTER_CONFIG_SCHEMAS.values())},
        help_text="As the adapter kind requires: python {handler}, http {url, credential_ref?}, "
        "mcp {server, remote_name, definition_hash, proposed_risk?}.",
    )


class ToolDependencySerializer(serializers.Serializer):
    id = serializers.UUIDField(source="tool_version.id")
    name = serializers.CharField(source="tool_version.tool.name")
    version = serializers.CharField(source="tool_version.version")
    status = serializers.CharField(source="tool_version.status")


class SkillVersionSerializer(VersionFieldsSerializer):
    skill = DefinitionRefSerializer(read_only=True)
    tool_dependencies = ToolDependencySerializer(many=True, read_only=True)

    class Meta:
        model = SkillVersion
        fields = [
            *VersionFieldsSerializer.version_fields,
            "skill",
            *SKILL_CONTENT_FIELDS,
            "tool_dependencies",
        ]
        read_only_fields = fields


class SkillVersionCreateSerializer(StrictSerializer):
    name = StrictCharField(max_length=64, validators=[SKILL_NAME_VALIDATOR])
    namespace = namespace_field()
    version = SemverField()
    description = StrictCharField()
    instructions = StrictCharField(required=False, allow_blank=True)
    triggers = DocumentField(document_schema=TRIGGERS_SCHEMA)
    required_inputs = DocumentField(document_schema=REQUIRED_INPUTS_SCHEMA, required=False)
    tool_dependencies = serializers.ListField(
        child=StrictCharField(max_length=200, validators=[TOOL_REFERENCE_VALIDATOR]),
        required=False,
        max_length=MAX_TOOL_DEPENDENCIES,
        help_text='Pinned tools as "name@version", e.g. "project_search@2"; as '
        '"namespace/name@version" where the name is taken in several namespaces.',
    )
    rules = DocumentField(document_schema=SKILL_RULES_SCHEMA, required=False)
    examples = DocumentField(document_schema=EXAMPLES_SCHEMA, required=False)
    output_contract = DocumentField(document_schema=OUTPUT_CONTRACT_SCHEMA)
    acceptance_rules = DocumentField(document_schema=ACCEPTANCE_RULES_SCHEMA, required=False)
    workflow = serializers.ChoiceField(
        choices=["", *sorted(WORKFLOWS)],
        required=False,
        help_text="The workflow, defined in code, that runs this skill; "
        "empty: the generic agent loop.",
    )


class LifecycleSerializer(StrictSerializer):
    reason = StrictCharField(required=False, allow_blank=True, max_length=2000)


def _override_reason(doing: str) -> StrictCharField:
    return StrictCharField(
        required=False,
        allow_blank=True,
        max_length=2000,
        help_text=f"{doing} although the release gate fails (tenant or platform admins): why.",
    )


class SkillPublishSerializer(StrictSerializer):
    override_reason = _override_reason("Publish")


class SkillRollbackSerializer(StrictSerializer):
    override_reason = _override_reason("Roll back")
