from django.apps import AppConfig


class RegistryConfig(AppConfig):
    """The control plane: tenants, roles, versioned tools and skills, configs, policies."""

    name = "registry"
    verbose_name = "Registry"
