from django.apps import AppConfig


class RegistryConfig(AppConfig):
    """The control plane: tenants, roles, versioned tools and skills, configs, policies."""

    name = "registry"
    verbose_name = "Registry"

    def ready(self) -> None:
        from registry.mcp.logs import mcp_logs_withhold

        mcp_logs_withhold()
