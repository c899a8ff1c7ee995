from rest_framework import serializers

from config.api import StrictSerializer, StrictSlugField, StrictUUIDField
from evaluations.choices import METRIC_DEFINITIONS, AttackVector
from evaluations.models import EvalCase, EvalCaseResult, EvalRun, EvalSuite


class EvalCaseSerializer(serializers.ModelSerializer):
    # Declared: DRF drops `allow_blank` from a read-only model field, so the schema left out
    # the empty vector of every task case.
    vector = serializers.ChoiceField(
        choices=AttackVector.choices,
        allow_blank=True,
        read_only=True,
        help_text="Where an attack case's payload is planted; empty for a task case.",
    )

    class Meta:
        model = EvalCase
        fields = [
            "id",
            "key",
            "title",
            "messages",
            "metadata",
            "session_state",
            "fixture",
            "expected",
            "vector",
            "payload",
            "forbidden",
        ]
        read_only_fields = fields


class EvalSuiteSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(
        slug_field="slug",
        read_only=True,
        allow_null=True,
        help_text="null: a platform suite every tenant may run.",
    )
    case_count = serializers.IntegerField(read_only=True)

    class Meta:
        model = EvalSuite
        fields = ["id", "key", "name", "kind", "skill_name", "description", "tenant", "case_count"]
        read_only_fields = fields


class EvalSuiteDetailSerializer(EvalSuiteSerializer):
    cases = EvalCaseSerializer(many=True, read_only=True)

    class Meta(EvalSuiteSerializer.Meta):
        fields = [*EvalSuiteSerializer.Meta.fields, "cases"]
        read_only_fields = fields


class EvalRunSerializer(serializers.ModelSerializer):
    """An eval run with its progress and, once finished, its metrics (each defined in
    `metric_definitions`)."""

    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    suite = serializers.SlugRelatedField(slug_field="key", read_only=True)
    skill_version = serializers.CharField(source="skill_version.qualified_name", read_only=True)
    model_config = serializers.SlugRelatedField(slug_field="name", read_only=True)
    agent_config = serializers.SlugRelatedField(slug_field="name", read_only=True)
    created_by = serializers.CharField(source="created_by.get_username", read_only=True)
    metric_definitions = serializers.SerializerMethodField()

    class Meta:
        model = EvalRun
        fields = [
            "id",
            "tenant",
            "suite",
            "skill_version",
            "skill_content_hash",
            "suite_content_hash",
            "model_config",
            "agent_config",
            "status",
            "status_reason",
            "cases_done",
            "cases_total",
            "metrics",
            "metric_definitions",
            "created_by",
            "created_at",
            "started_at",
            "finished_at",
        ]
        read_only_fields = fields

    def get_metric_definitions(self, eval_run: EvalRun) -> dict[str, str]:
        return {str(metric): text for metric, text in METRIC_DEFINITIONS.items()}


class EvalCaseResultSerializer(serializers.ModelSerializer):
    case = serializers.SlugRelatedField(slug_field="key", read_only=True)

    class Meta:
        model = EvalCaseResult
        fields = ["case", "passed", "failures", "observed", "run", "created_at"]
        read_only_fields = fields


class EvalRunStartSerializer(StrictSerializer):
    suite = StrictUUIDField()
    skill_version = StrictUUIDField()
    agent = StrictSlugField(help_text="The agent configuration of your tenant, by name.")
    model_config = StrictSlugField(
        required=False, help_text="Another model to evaluate with, by name; default: the agent's."
    )
