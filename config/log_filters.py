"""Filters of the platform's log handlers."""

import logging


class SuspiciousRequestAsWarning(logging.Filter):
    """Django logs a request it refuses as suspicious (a Host header not in ALLOWED_HOSTS, too
    many fields, a tampered session) at ERROR, with the exception's traceback, under
    `django.security.<exception>`. The client has its 400 and nothing failed on the server:
    what the operator needs is one line saying what was refused, at WARNING."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("django.security.") and record.levelno > logging.WARNING:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True
