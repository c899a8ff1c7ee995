from django.core.management.base import BaseCommand, CommandError

from registry.errors import McpServerUnavailable
from registry.models import McpServer
from registry.services.mcp import mcp_server_discover, mcp_servers_discover_all


class Command(BaseCommand):
    help = (
        "Discover the tools, prompts and resources of MCP servers: new remote tools become "
        "drafts for review, changed or removed ones are marked."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--server", help="one server's name (default: every enabled one)")

    def handle(self, *args, server: str | None = None, **options) -> None:
        if server is None:
            for summary in mcp_servers_discover_all():
                self.stdout.write(summary)
            return
        found = McpServer.objects.filter(name=server)
        if found.count() != 1:
            raise CommandError(f"{found.count()} servers are named {server!r}.")
        try:
            self.stdout.write(mcp_server_discover(server=found.get(), actor=None).summary())
        except McpServerUnavailable as error:
            raise CommandError(error.message) from error
