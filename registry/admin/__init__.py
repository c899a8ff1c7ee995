from registry.admin import configs, definitions, mcp, site, tenancy

__all__ = ["configs", "definitions", "mcp", "site", "tenancy"]
