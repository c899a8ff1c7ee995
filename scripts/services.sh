#!/usr/bin/env bash
# Start PostgreSQL and Redis on this machine if they are not answering, then wait for both.
set -euo pipefail

pg_up() { pg_isready -h 127.0.0.1 -p 5432 -q; }
redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; }

if ! pg_up; then
  echo "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -n 1)" main start
fi
if ! redis_up; then
  echo "starting Redis"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi
for _ in $(seq 1 30); do
  if pg_up && redis_up; then exit 0; fi
  sleep 1
done
echo "PostgreSQL or Redis did not come up" >&2
exit 1
