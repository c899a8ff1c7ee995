"""The broker transport the data plane publishes its tasks through (Redis under `make test`)."""

import json
import uuid

import redis
from django.conf import settings

from config.broker import Channel
from config.celery import app
from tests.celery_worker import kombu_routes


def test_tasks_are_published_to_redis_through_one_client_per_channel():
    queue = f"agentgov-broker-test-{uuid.uuid4().hex}"
    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        with app.connection_for_write() as connection:
            channel = connection.default_channel
            assert isinstance(channel, Channel)
            with app.producer_or_acquire() as producer:
                for number in range(3):
                    app.send_task(
                        "runs.tasks.run_advance",
                        kwargs={"run_id": str(number)},
                        queue=queue,
                        producer=producer,
                    )
                sending = producer.channel._create_client()
                assert producer.channel._create_client() is sending

        messages = [json.loads(raw) for raw in client.lrange(queue, 0, -1)]
        assert sorted(message["headers"]["kwargsrepr"] for message in messages) == [
            "{'run_id': '0'}",
            "{'run_id': '1'}",
            "{'run_id': '2'}",
        ]
    finally:
        client.delete(queue, *kombu_routes(queue))
        client.close()


def test_a_channel_that_drops_its_pool_sends_through_its_new_one():
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        before = channel._create_client()
        channel._disconnect_pools()

        after = channel._create_client()

        assert after is not before
        assert after.connection_pool is channel.pool
        assert after.ping()
