from django.core.management.base import BaseCommand

from evaluations.starter import suites_install


class Command(BaseCommand):
    help = "Install or bring up to date the evaluation suites shipped with the platform."

    def handle(self, *args, **options) -> None:
        for suite, created in suites_install():
            verb = "installed" if created else "updated"
            self.stdout.write(f"{verb} {suite.key}: {suite.cases.count()} cases")
