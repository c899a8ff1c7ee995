from django.core.management.base import BaseCommand, CommandError

from evaluations.errors import ValidationFailed
from evaluations.starter import suites_install


class Command(BaseCommand):
    help = "Install or bring up to date the evaluation suites shipped with the platform."

    def handle(self, *args, **options) -> None:
        try:
            installed = suites_install()
        except ValidationFailed as error:
            raise CommandError(str(error)) from error
        for suite, created in installed:
            verb = "installed" if created else "updated"
            self.stdout.write(f"{verb} {suite.key}: {suite.cases.count()} cases")
