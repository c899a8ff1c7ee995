import signal
import sys

from celery.beat import Service
from django.core.management.base import BaseCommand

from config.celery import app


class Command(BaseCommand):
    help = (
        "Send the periodic tasks that are due (the sweeps, MCP discovery, scheduled tasks), as "
        "`celery beat` does and from its schedule: until stopped, or once with --once. With "
        "Celery in eager mode (the embedded default, which has no beat and no worker) each "
        "runs in this process."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--once", action="store_true", help="send what is due now and exit")

    def handle(self, *args, once: bool, **options) -> None:
        # The tasks modules, as `celery beat` imports them: a task this process does not know
        # would be sent to the broker, where under eager no worker reads it.
        app.loader.import_default_modules()
        beat = Service(app, scheduler_cls=app.conf.beat_scheduler)
        if once:
            # A tick sends at most one due task and then answers 0; otherwise how long to wait.
            while beat.scheduler.tick() <= 0:
                pass
            beat.sync()
            return
        # Stopped by SIGTERM (as `make run` stops it), it first writes when each task last ran.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit())
        beat.start()
