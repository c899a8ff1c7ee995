"""An MCP server (stdio) that serves exactly what a JSON spec file says, re-read on every
request, past the checks the SDK's higher-level server makes: tool, prompt and resource
listings, and one answer to every call. The file's path is in HOSTILE_SPEC. Every tools/call is
appended to the spec's `call_log`, when it names one, and every listing's page asked for to its
`list_log`; with `down` set, a process started exits before it answers anything (a server that
cannot be reached). A listing is one page, unless `paging` says otherwise (`page`)."""

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


def page(kind: str, request: types.Request) -> tuple[list, str | None]:
    """The spec's `kind` (tools, prompts or resources) on the page the request's cursor names,
    and the next page's cursor. `paging` "one-per-page" lists one item a page; "endless" does
    too, then empty pages, never giving the last; "same-cursor" lists every item on a page
    whose next page's cursor is always "again"."""
    items, paging = spec().get(kind, []), spec().get("paging")
    cursor = request.params.cursor if request.params else None
    if log := spec().get("list_log"):
        with open(log, "a") as pages:
            pages.write(f"{kind} {cursor}\n")
    if paging == "same-cursor":
        return items, "again"
    if paging not in ("one-per-page", "endless"):
        return items, None
    at = int(cursor or 0)
    more = paging == "endless" or at + 1 < len(items)
    return items[at : at + 1], str(at + 1) if more else None


async def list_tools(request: types.ListToolsRequest) -> types.ServerResult:
    items, cursor = page("tools", request)
    tools = [types.Tool.model_validate(tool) for tool in items]
    return types.ServerResult(types.ListToolsResult(tools=tools, nextCursor=cursor))


async def call_tool(request: types.CallToolRequest) -> types.ServerResult:
    if log := spec().get("call_log"):
        with open(log, "a") as calls:
            calls.write(request.params.name + "\n")
    return types.ServerResult(types.CallToolResult.model_validate(spec()["result"]))


async def list_resources(request: types.ListResourcesRequest) -> types.ServerResult:
    items, cursor = page("resources", request)
    resources = [types.Resource.model_validate(item) for item in items]
    return types.ServerResult(types.ListResourcesResult(resources=resources, nextCursor=cursor))


async def list_prompts(request: types.ListPromptsRequest) -> types.ServerResult:
    items, cursor = page("prompts", request)
    prompts = [types.Prompt.model_validate(item) for item in items]
    return types.ServerResult(types.ListPromptsResult(prompts=prompts, nextCursor=cursor))


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
