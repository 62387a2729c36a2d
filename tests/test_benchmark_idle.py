"""The idle benchmark's count of transactions from the server's log (``benchmarks/server_log.py``), on lines
as PostgreSQL 15 writes them with ``log_statement = 'all'`` and ``log_min_messages = debug5``.

``pg_stat_database`` counts the server's catch-up transactions with ours (DDL anywhere on the server makes
them in idle backends): the log tells them apart, and shows the transactions no statement does.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import server_log  # noqa: E402

S = "2026-12-06 23:33:2"  # the lines' stamps: S + second + ".mmm"

LOG = f"""\
{S}0.100 UTC [101] postgres@bench DEBUG:  bind <unnamed> to _pg3_1
{S}0.100 UTC [101] postgres@bench DEBUG:  StartTransaction(1) name: unnamed; blockState: DEFAULT; state: INPROGRESS
{S}1.182 UTC [101] postgres@bench DEBUG:  StartTransaction(1) name: unnamed; blockState: DEFAULT; state: INPROGRESS
{S}1.182 UTC [101] postgres@bench LOG:  execute _pg3_1: UPDATE "s".message AS m SET state = 'running', attempt = m.attempt + 1, delivery = gen_random_uuid()
{S}1.182 UTC [101] postgres@bench DETAIL:  parameters: $1 = '30', $2 = 'vm:1:ab/q1/10'
{S}1.182 UTC [101] postgres@bench DEBUG:  CommitTransaction(1) name: unnamed; blockState: STARTED; state: INPROGRESS
{S}1.269 UTC [101] postgres@bench DEBUG:  ProcessCatchupEvent outside transaction
{S}1.269 UTC [101] postgres@bench DEBUG:  sinval catchup complete, cleaning queue
{S}1.269 UTC [101] postgres@bench DEBUG:  sending sinval catchup signal to PID 102
{S}1.269 UTC [101] postgres@bench DEBUG:  StartTransaction(1) name: unnamed; blockState: DEFAULT; state: INPROGRESS
{S}1.269 UTC [101] postgres@bench DEBUG:  CommitTransaction(1) name: unnamed; blockState: STARTED; state: INPROGRESS
{S}2.000 UTC [102] postgres@bench DEBUG:  parse _pg3_2: INSERT INTO "s".process AS p (process_id, host)
{S}2.000 UTC [102] postgres@bench DEBUG:  StartTransaction(1) name: unnamed; blockState: DEFAULT; state: INPROGRESS
{S}2.000 UTC [102] postgres@bench DEBUG:  CommitTransaction(1) name: unnamed; blockState: STARTED; state: INPROGRESS
{S}2.001 UTC [102] postgres@bench DEBUG:  bind <unnamed> to _pg3_2
{S}2.001 UTC [102] postgres@bench DEBUG:  StartTransaction(1) name: unnamed; blockState: DEFAULT; state: INPROGRESS
{S}2.001 UTC [102] postgres@bench LOG:  execute _pg3_2: INSERT INTO "s".process AS p (process_id, host)
{S}2.002 UTC [102] postgres@bench DEBUG:  CommitTransaction(1) name: unnamed; blockState: STARTED; state: INPROGRESS
{S}2.100 UTC [103] postgres@bench DEBUG:  StartTransaction(1) name: unnamed; blockState: DEFAULT; state: INPROGRESS
{S}2.100 UTC [103] postgres@bench LOG:  execute <unnamed>: SELECT pg_advisory_lock($1::int, 0)
{S}2.100 UTC [103] postgres@bench DETAIL:  parameters: $1 = '423647782'
{S}3.100 UTC [103] postgres@bench ERROR:  canceling statement due to lock timeout
{S}3.100 UTC [103] postgres@bench STATEMENT:  SELECT pg_advisory_lock($1::int, 0)
{S}3.100 UTC [103] postgres@bench DEBUG:  cache state reset
{S}3.101 UTC [103] postgres@bench DEBUG:  StartTransaction(1) name: unnamed; blockState: DEFAULT; state: INPROGRESS
{S}3.101 UTC [103] postgres@bench DEBUG:  CommitTransaction(1) name: unnamed; blockState: STARTED; state: INPROGRESS
{S}3.200 UTC [102] postgres@bench DEBUG:  StartTransaction(1) name: unnamed; blockState: DEFAULT; state: INPROGRESS
{S}3.200 UTC [102] postgres@bench LOG:  statement:
{S}3.200 UTC [102] postgres@bench DEBUG:  CommitTransaction(1) name: unnamed; blockState: STARTED; state: INPROGRESS
{S}3.300 UTC [999] postgres@other DEBUG:  StartTransaction(1) name: unnamed; blockState: DEFAULT; state: INPROGRESS
{S}3.300 UTC [999] postgres@other LOG:  statement: CREATE SCHEMA x
{S}3.300 UTC [999] postgres@other DEBUG:  CommitTransaction(1) name: unnamed; blockState: STARTED; state: INPROGRESS
{S}9.500 UTC [101] postgres@bench DEBUG:  StartTransaction(1) name: unnamed; blockState: DEFAULT; state: INPROGRESS
{S}9.500 UTC [101] postgres@bench LOG:  statement: BEGIN
{S}9.500 UTC [101] postgres@bench LOG:  statement: SELECT pg_try_advisory_xact_lock(1, '"s".queue_minute'::regclass::oid::int)
{S}9.501 UTC [101] postgres@bench LOG:  statement: COMMIT
{S}9.501 UTC [101] postgres@bench DEBUG:  CommitTransaction(1) name: unnamed; blockState: END; state: INPROGRESS
"""


def test_the_log_tells_each_transaction_s_kind_and_the_server_s_catch_ups_apart() -> None:
    """Given a window of the log, I expect each transaction of the backends asked about that ended in it
    counted once by what it ran: a catch-up (no statement, after the server's sinval lines or a cache reset)
    apart, a Parse sent alone as a prepare, a lock wait that timed out as rolled back; another database's
    backend, and a transaction that ended before the window, not counted."""
    found = server_log.count(LOG.splitlines(), {101, 102, 103}, f"{S}1.000", f"{S}9.999")
    assert found == {
        "claim (idle poll)": 1,
        server_log.CATCH_UP: 2,
        server_log.PREPARE: 1,
        "heartbeat": 1,
        "door wait (10 s in the lock queue) (rolled back)": 1,
        "connection check (empty statement)": 1,
        "charts' sample": 1,
    }
    # ... and only up to the window's end, only the backends asked about
    assert server_log.count(LOG.splitlines(), {101}, f"{S}1.000", f"{S}2.000") == {
        "claim (idle poll)": 1,
        server_log.CATCH_UP: 1,
    }


def test_a_line_prefix_with_the_stamp_and_the_pid_alone_is_read() -> None:
    """initdb's ``log_line_prefix`` (``%m [%p] ``, a server of the benchmark's own) carries no user or database."""
    lines = [
        f"{S}1.000 UTC [7] DEBUG:  StartTransaction(1) name: unnamed; blockState: DEFAULT; state: INPROGRESS",
        f"{S}1.000 UTC [7] LOG:  execute <unnamed>: WITH expired AS ( SELECT message_id FROM x )",
        f"{S}1.001 UTC [7] DEBUG:  CommitTransaction(1) name: unnamed; blockState: STARTED; state: INPROGRESS",
    ]
    assert server_log.count(lines, {7}, f"{S}0.000", f"{S}9.000") == {"rescue": 1}
