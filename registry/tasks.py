"""Periodic work of the control plane."""

import logging

from celery import shared_task

from registry.services.mcp import mcp_servers_discover_all

logger = logging.getLogger(__name__)


@shared_task
def mcp_servers_discover() -> list[str]:
    """Discover every enabled MCP server: new drafts for review, drift and removals marked."""
    summaries = mcp_servers_discover_all(actor=None)
    for summary in summaries:
        logger.info("MCP discovery: %s", summary)
    return summaries
