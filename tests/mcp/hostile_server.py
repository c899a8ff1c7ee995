"""An MCP server (stdio) that serves exactly what a JSON spec file says, re-read on every
request, past the checks the SDK's higher-level server makes: tool, prompt and resource
listings, and one answer to every call. The file's path is in HOSTILE_SPEC. Every tools/call is
appended to the spec's `call_log`, when it names one; with `down` set, a process started
exits before it answers anything (a server that cannot be reached)."""

import asyncio
import json
import os
import sys
from pathlib import Path

from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server


def spec() -> dict:
    return json.loads(Path(os.environ["HOSTILE_SPEC"]).read_text() or "{}")


server = Server("hostile")


async def list_tools(request: types.ListToolsRequest) -> types.ServerResult:
    tools = [types.Tool.model_validate(tool) for tool in spec().get("tools", [])]
    return types.ServerResult(types.ListToolsResult(tools=tools))


async def call_tool(request: types.CallToolRequest) -> types.ServerResult:
    if log := spec().get("call_log"):
        with open(log, "a") as calls:
            calls.write(request.params.name + "\n")
    return types.ServerResult(types.CallToolResult.model_validate(spec()["result"]))


async def list_resources(request: types.ListResourcesRequest) -> types.ServerResult:
    resources = [types.Resource.model_validate(item) for item in spec().get("resources", [])]
    return types.ServerResult(types.ListResourcesResult(resources=resources))


async def list_prompts(request: types.ListPromptsRequest) -> types.ServerResult:
    prompts = [types.Prompt.model_validate(item) for item in spec().get("prompts", [])]
    return types.ServerResult(types.ListPromptsResult(prompts=prompts))


server.request_handlers[types.ListToolsRequest] = list_tools
server.request_handlers[types.CallToolRequest] = call_tool
server.request_handlers[types.ListResourcesRequest] = list_resources
server.request_handlers[types.ListPromptsRequest] = list_prompts


async def main() -> None:
    async with stdio_server() as (read, write):
        options = server.create_initialization_options(
            notification_options=None, experimental_capabilities={}
        )
        await server.run(read, write, options)


if __name__ == "__main__":
    if spec().get("down"):
        sys.exit(1)
    asyncio.run(main())
