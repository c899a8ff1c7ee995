from django.apps import AppConfig


class ExamplesConfig(AppConfig):
    """The running example's business systems: projects with their week, and a directory."""

    name = "examples"
    verbose_name = "Example business systems"
