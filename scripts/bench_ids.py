"""`make bench-ids`: what the kind of row id costs the event log once it is large.

In a scratch database (`agentgov_bench_ids`, dropped afterwards) it makes a table shaped like
the event log's hot part (a UUID primary key, the run's UUID, `seq` unique per run, a JSON
payload), fills it with BENCH_IDS_ROWS rows (1,000,000) by COPY, checkpoints, and then
inserts BENCH_IDS_MEASURED rows (20,000), 20 per transaction as a run's steps write them. It
does this once with random ids (`uuid.uuid4`, the ids before) and once with the platform's
time-ordered ids (`config.ids.time_ordered_id`, UUID version 7), each for rows and runs, and
prints for each: the WAL written per row, microseconds per row and the primary key's size.

The WAL is what the ids change most: after a checkpoint, PostgreSQL logs a page whole the
first time a row lands on it, and random ids land each row on another page of the index.
"""

import os
import sys
import time
import uuid
from pathlib import Path

import psycopg
from scratch_database import ScratchDatabase

BASE_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BASE_DIR))

from config.ids import time_ordered_id  # noqa: E402

DATABASE = "agentgov_bench_ids"
ROWS = int(os.environ.get("BENCH_IDS_ROWS", "1000000"))
MEASURED = int(os.environ.get("BENCH_IDS_MEASURED", "20000"))
EVENTS_PER_STEP = 20
PAYLOAD = '{"type": "tool.completed", "call_id": "call_1", "status": "ok"}'
KINDS = {"random (uuid4)": uuid.uuid4, "time-ordered (uuid7)": time_ordered_id}


def _measure(connection: psycopg.Connection, new_id) -> dict[str, float]:
    connection.execute("DROP TABLE IF EXISTS event_ids")
    connection.execute(
        "CREATE TABLE event_ids (id uuid PRIMARY KEY, run_id uuid NOT NULL, seq integer NOT NULL,"
        " payload jsonb NOT NULL, UNIQUE (run_id, seq))"
    )
    with connection.cursor().copy("COPY event_ids (id, run_id, seq, payload) FROM STDIN") as copy:
        for row in range(ROWS):
            if row % EVENTS_PER_STEP == 0:
                run_id = new_id()
            copy.write_row((new_id(), run_id, row % EVENTS_PER_STEP, PAYLOAD))
    connection.execute("VACUUM ANALYZE event_ids")
    connection.execute("CHECKPOINT")
    (start,) = connection.execute("SELECT pg_current_wal_lsn()").fetchone()
    connection.autocommit = False
    started = time.perf_counter()
    with connection.cursor() as cursor:
        for _ in range(MEASURED // EVENTS_PER_STEP):
            run_id = new_id()
            cursor.executemany(
                "INSERT INTO event_ids VALUES (%s, %s, %s, %s)",
                [(new_id(), run_id, seq, PAYLOAD) for seq in range(EVENTS_PER_STEP)],
            )
            connection.commit()
    seconds = time.perf_counter() - started
    connection.autocommit = True
    (wal,) = connection.execute(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", [start]
    ).fetchone()
    (size,) = connection.execute("SELECT pg_relation_size('event_ids_pkey')").fetchone()
    connection.execute("DROP TABLE event_ids")
    rows = MEASURED // EVENTS_PER_STEP * EVENTS_PER_STEP
    return {"wal": float(wal) / rows, "us": seconds * 1e6 / rows, "index_mb": size / 1e6}


def main() -> None:
    scratch = ScratchDatabase(DATABASE)
    scratch.recreate()
    try:
        with psycopg.connect(scratch.url, autocommit=True) as connection:
            print(f"bench-ids: {ROWS:,} rows in the table, then {MEASURED:,} inserted and timed")
            figures = {kind: _measure(connection, new_id) for kind, new_id in KINDS.items()}
    finally:
        scratch.drop()
    for kind, figure in figures.items():
        print(
            f"   {kind:22} WAL per row {figure['wal']:7.0f} B   {figure['us']:6.1f} us per row"
            f"   primary key {figure['index_mb']:5.1f} MB"
        )
    random, ordered = figures.values()
    print(
        f"   time-ordered / random: WAL {ordered['wal'] / random['wal']:.2f}, "
        f"time {ordered['us'] / random['us']:.2f}, primary key "
        f"{ordered['index_mb'] / random['index_mb']:.2f}"
    )


if __name__ == "__main__":
    main()
