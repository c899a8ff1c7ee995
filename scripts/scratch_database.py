"""A scratch PostgreSQL database for a benchmark, on the server of DATABASE_URL: created
afresh (never the development or a test database) and dropped afterwards."""

import os
import sys
from urllib.parse import urlsplit, urlunsplit

import psycopg


class ScratchDatabase:
    def __init__(self, name: str) -> None:
        configured = os.environ.get("DATABASE_URL", "")
        if not configured.startswith(("postgres://", "postgresql://")):
            sys.exit("make bench needs DATABASE_URL to name a PostgreSQL server.")
        parts = urlsplit(configured)
        self.name = name
        self.maintenance_url = urlunsplit(parts._replace(path="/postgres"))
        self.url = urlunsplit(parts._replace(path=f"/{name}"))

    def recreate(self) -> None:
        with psycopg.connect(self.maintenance_url, autocommit=True) as connection:
            connection.execute(f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)")
            connection.execute(f"CREATE DATABASE {self.name}")

    def drop(self) -> None:
        with psycopg.connect(self.maintenance_url, autocommit=True) as connection:
            connection.execute(f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)")
