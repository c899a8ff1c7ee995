from django.apps import AppConfig


class EvaluationsConfig(AppConfig):
    """Evaluation suites, eval runs, metrics and release gates."""

    name = "evaluations"
