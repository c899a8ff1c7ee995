from django.core.management.base import BaseCommand, CommandError
from django.db.models import Q

from registry.errors import McpServerUnavailable
from registry.models import McpServer
from registry.services.mcp import mcp_server_discover, mcp_servers_discover_all


class Command(BaseCommand):
    help = (
        "Discover the tools, prompts and resources of MCP servers: new remote tools become "
        "drafts for review, changed or removed ones are marked."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--server",
            help="one server, by its name or as it is shown, tenant/name (platform/name for a "
            "platform-wide one); default: every enabled one",
        )

    def handle(self, *args, server: str | None = None, **options) -> None:
        if server is None:
            for summary in mcp_servers_discover_all():
                self.stdout.write(summary)
            return
        if "/" in server:
            # Names are unique per tenant only: two tenants may each have "projects".
            owner, name = server.split("/", 1)
            owned = Q(tenant__slug=owner)
            if owner == "platform":
                owned |= Q(tenant__isnull=True)
            found = McpServer.objects.filter(owned, name=name)
        else:
            found = McpServer.objects.filter(name=server)
        if found.count() != 1:
            raise CommandError(
                f"{found.count()} servers are named {server!r}: name one as tenant/name."
            )
        try:
            self.stdout.write(mcp_server_discover(server=found.get(), actor=None).summary())
        except McpServerUnavailable as error:
            raise CommandError(error.message) from error
