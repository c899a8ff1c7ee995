import uuid

from django.conf import settings
from django.db import models

from config.history import history_records
from evaluations.choices import EvalRunStatus


class EvalRun(models.Model):
    """A suite run against exactly one skill version, model config and agent config, in a
    sandbox tenant of its own. Each case's result is kept as soon as it is known, so a run
    resumes after a worker restart where it stopped."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(
        "registry.Tenant", on_delete=models.PROTECT, related_name="eval_runs"
    )
    suite = models.ForeignKey(
        "evaluations.EvalSuite", on_delete=models.PROTECT, related_name="runs"
    )
    skill_version = models.ForeignKey(
        "registry.SkillVersion", on_delete=models.PROTECT, related_name="eval_runs"
    )
    skill_content_hash = models.CharField(
        max_length=64,
        editable=False,
        help_text="sha256 of the version's content and pinned tools when the run started: a "
        "draft edited since is not what this run measured.",
    )
    suite_content_hash = models.CharField(
        max_length=64,
        editable=False,
        help_text="sha256 of the suite's cases when the run started: a suite whose cases "
        "changed since is not what this run measured.",
    )
    suite_changed = models.BooleanField(
        default=False,
        editable=False,
        help_text="A case of the suite was added, changed or moved, or its kind changed, while "
        "the run was queued or running: its cases were measured against no one suite (a change "
        "undone before it ended gives back the hash it started with), and no release gate "
        "counts it.",
    )
    skill_version_changed = models.BooleanField(
        default=False,
        editable=False,
        help_text="The draft under test was edited (its content or pinned tools) while the "
        "run was queued or running: its cases measured more than one content (an edit undone "
        "before it ended gives back the hash it started with), and no release gate counts it.",
    )
    model_config = models.ForeignKey(
        "registry.ModelConfig", on_delete=models.PROTECT, related_name="eval_runs"
    )
    agent_config = models.ForeignKey(
        "registry.AgentConfig", on_delete=models.PROTECT, related_name="eval_runs"
    )
    sandbox = models.OneToOneField(
        "registry.Tenant",
        on_delete=models.PROTECT,
        related_name="sandbox_eval_run",
        null=True,
        blank=True,
        editable=False,
    )
    status = models.CharField(
        max_length=16, choices=EvalRunStatus.choices, default=EvalRunStatus.QUEUED
    )
    status_reason = models.TextField(blank=True)
    cases = models.ManyToManyField(
        "evaluations.EvalCase",
        related_name="+",
        blank=True,
        editable=False,
        help_text="The suite's cases when the run started, the ones its content hash was taken "
        "of: those it runs, a case added since being left to the next run.",
    )
    cases_total = models.PositiveIntegerField(default=0)
    cases_done = models.PositiveIntegerField(default=0)
    metrics = models.JSONField(default=dict, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveSmallIntegerField(
        default=0,
        editable=False,
        help_text="Tasks in a row that raised before a case's result was kept.",
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="eval_runs"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    history = history_records()

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["skill_version", "suite", "status"])]

    def __str__(self) -> str:
        return f"{self.suite.key} on {self.skill_version_id} ({self.status})"


class EvalCaseResult(models.Model):
    """What one case's run did, whether it met its expectations and why not."""

    eval_run = models.ForeignKey(EvalRun, on_delete=models.CASCADE, related_name="results")
    case = models.ForeignKey("evaluations.EvalCase", on_delete=models.PROTECT, related_name="+")
    run = models.ForeignKey(
        "runs.Run", on_delete=models.PROTECT, related_name="+", null=True, blank=True
    )
    passed = models.BooleanField()
    failures = models.JSONField(default=list)
    observed = models.JSONField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["eval_run", "case__key"]
        constraints = [
            models.UniqueConstraint(fields=["eval_run", "case"], name="evalcaseresult_once"),
        ]

    def __str__(self) -> str:
        return f"{self.case_id}: {'passed' if self.passed else 'failed'}"
