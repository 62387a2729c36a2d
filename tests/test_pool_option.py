"""A broker on a connection pool the application owns."""

import dramatiq
from helpers import running_worker
from psycopg_pool import ConnectionPool

from dramatiq_pg_fenced import PostgresBroker


def test_broker_on_a_given_pool_runs_actors_and_leaves_the_pool_open(dramatiq_pg_url, dramatiq_pg_broker_factory):
    schema = dramatiq_pg_broker_factory().schema  # migrated, dropped after the test
    pool = ConnectionPool(dramatiq_pg_url, kwargs={"autocommit": True}, min_size=1, max_size=4, open=True)
    try:
        broker = PostgresBroker(pool=pool, schema=schema)
        seen = []

        @dramatiq.actor(broker=broker)
        def record(n):
            seen.append(n)

        with running_worker(broker):
            for n in range(5):
                record.send(n)
            broker.join(record.queue_name, timeout=20_000)
        assert sorted(seen) == [0, 1, 2, 3, 4]
        broker.close()
        with pool.connection() as conn:  # the broker did not close what it does not own
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        pool.close()
