from django.apps import AppConfig


class ApprovalsConfig(AppConfig):
    """Business actions: frozen, hashed side effects approved by a human and executed once."""

    name = "approvals"
