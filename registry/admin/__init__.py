from registry.admin import configs, definitions, mcp, tenancy

__all__ = ["configs", "definitions", "mcp", "tenancy"]
