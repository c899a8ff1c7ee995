from registry.admin import configs, definitions, tenancy

__all__ = ["configs", "definitions", "tenancy"]
