from django.core.management.base import BaseCommand

from registry.demo import ADMIN_USERNAME, DEMO_PASSWORD, PEOPLE, seed_demo


class Command(BaseCommand):
    help = "Load the running example's registry content (idempotent)."

    def handle(self, *args, **options) -> None:
        report = seed_demo()
        if report.created:
            for what in report.created:
                self.stdout.write(f"created {what}")
        else:
            self.stdout.write("demo data already present; nothing changed")
        logins = ", ".join([ADMIN_USERNAME, *(username for username, *_ in PEOPLE)])
        self.stdout.write(self.style.SUCCESS(f"demo logins ({DEMO_PASSWORD}): {logins}"))
