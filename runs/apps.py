from django.apps import AppConfig


class RunsConfig(AppConfig):
    """The data plane: ingress, governed runs, the bounded model/tool loop, the event log."""

    name = "runs"
