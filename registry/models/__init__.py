from registry.models.configs import AgentConfig, ModelConfig
from registry.models.generation import RegistryGeneration
from registry.models.mcp import (
    McpPrompt,
    McpRemoteTool,
    McpResource,
    McpServer,
    McpToolDefinition,
)
from registry.models.policies import Policy
from registry.models.rollouts import RolloutFlag
from registry.models.skills import Skill, SkillToolDependency, SkillVersion
from registry.models.tenancy import ApiToken, Membership, Tenant
from registry.models.tools import Tool, ToolVersion

__all__ = [
    "AgentConfig",
    "ApiToken",
    "McpPrompt",
    "McpRemoteTool",
    "McpResource",
    "McpServer",
    "McpToolDefinition",
    "Membership",
    "ModelConfig",
    "Policy",
    "RegistryGeneration",
    "RolloutFlag",
    "Skill",
    "SkillToolDependency",
    "SkillVersion",
    "Tenant",
    "Tool",
    "ToolVersion",
]
