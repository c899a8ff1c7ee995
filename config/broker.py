"""The Redis broker transport, with one client per channel for what it sends.

kombu's Redis channel makes a new `redis.Redis` for every message it publishes (the
connection pool is shared; the client, with its table of reply callbacks, is built anew),
which cost more than the LPUSH itself. A client is safe to share between threads: each
command takes a connection from the pool. Consuming (BRPOP, pub/sub) is left as kombu does it.
"""

from kombu.transport import redis


class Channel(redis.Channel):
    _sending_client = None

    def _create_client(self, asynchronous: bool = False):
        if asynchronous:
            return super()._create_client(asynchronous=True)
        if self._sending_client is None:
            self._sending_client = super()._create_client()
        return self._sending_client

    def _disconnect_pools(self) -> None:
        """After a fork or on close the channel drops its pool: the client bound to it goes
        with it, and the next message makes one on the channel's new pool."""
        self._sending_client = None
        super()._disconnect_pools()


class Transport(redis.Transport):
    Channel = Channel
