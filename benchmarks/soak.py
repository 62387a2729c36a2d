"""Soak: a steady trickle of sends for minutes, with and without a pinned xmin.

    python -m benchmarks.soak [--rate 300] [--minutes 10] [--pinned-minutes 5] [--pin 120:240]

Two runs, one after the other, each on a fresh schema with real ``dramatiq``
workers (2 processes x 8 threads): one ``send()`` at a time at ``--rate``
messages/s, to an actor that stamps when it started.

- **unpinned**: nothing else happens for ``--minutes``;
- **pinned**: another session holds a ``REPEATABLE READ`` transaction (its
  snapshot taken) open over the ``--pin`` seconds of the run, so vacuum may
  remove no row version newer than it: what a report, ``pg_dump`` or a
  forgotten ``BEGIN`` does to the database a queue lives in.

Per window of ``--window`` seconds (by send time) it prints the latency from
``send()`` to the actor's start (p50, p99), the producer's achieved rate, and,
sampled at the window's end, the message table's size (heap and indexes) and
its dead tuples (``pg_stat_user_tables``).  The two runs are printed side by
side; the machine is shared, so compare within one run.  Results go to
``benchmarks/results/soak.json`` (``--out`` names another file).

    python -m benchmarks.soak --goal [--long] [--statements]

The pinned soak of issue 41, alone: 200 sends/s, one-minute windows, five clean
minutes, the horizon pinned for 30 minutes (``--long``: 2 hours), five minutes
after the release; it ends with each goal's verdict, every pinned minute against
the clean minutes before the pin (``goals``).

With ``--statements`` it runs on a PostgreSQL server of its own with
``pg_stat_statements`` and ``auto_explain`` loaded (the plans of statements that took 100 ms or
more: the first and last three are printed) and prints, for the ten statements with the most
time under the pin, their mean time, shared buffers and reads per call in the
clean minutes, the first, middle and last pinned ones and those after: which
statement's cost grows with the pin.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from benchmarks import apps, statements
from benchmarks.run import RESULTS, Plan, PostgresDriver, Workers, log, percentile, wait_until

PLAN = Plan("soak", 1, 0, 0, 0.0, 0, 0.0, 0, 0, 5_000, 1)


#: Each statement's counters in pg_stat_statements (--statements), by queryid, for this database.
STATEMENTS = """
    SELECT queryid, calls, total_exec_time, shared_blks_hit + shared_blks_read, shared_blks_read,
           left(regexp_replace(query, '\\s+', ' ', 'g'), 100)
      FROM pg_stat_statements
     WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


class Sampler(threading.Thread):
    """Table size and dead tuples of the message table, once per window; with *statements*, every
    statement's counters too (pg_stat_statements), reset at the start."""

    def __init__(self, url: str, schema: str, window: float, start: float, statements: bool = False) -> None:
        super().__init__(daemon=True)
        self.url, self.schema, self.window, self.start_at = url, schema, window, start
        self.samples: list[dict[str, float]] = []
        self.statements: list[dict[int, tuple]] | None = [] if statements else None
        self.stopping = threading.Event()

    def run(self) -> None:
        table = f'"{self.schema}".message'
        with psycopg.connect(apps.pg_url(self.url, "bench-soak-sampler"), autocommit=True) as conn:
            if self.statements is not None:
                conn.execute("SELECT pg_stat_statements_reset()")
                self.statements.append({})
            k = 1
            while not self.stopping.wait(max(0.0, self.start_at + k * self.window - time.monotonic())):
                row = conn.execute(
                    "SELECT pg_total_relation_size(c.oid), coalesce(s.n_dead_tup, 0), coalesce(s.n_live_tup, 0),"
                    "       pg_relation_size(c.oid),"
                    "       (SELECT count(*) FROM pg_stat_activity WHERE backend_xmin IS NOT NULL"
                    "          AND application_name = 'bench-soak-pin')"
                    "  FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid"
                    " WHERE c.oid = %s::regclass",
                    [table],
                ).fetchone()
                assert row is not None
                self.samples.append(
                    {"mb": row[0] / 2**20, "dead": row[1], "live": row[2], "heap_mb": row[3] / 2**20, "pin_sessions": row[4]}
                )
                if self.statements is not None:
                    self.statements.append({r[0]: r[1:] for r in conn.execute(STATEMENTS)})
                k += 1


def soak(driver: PostgresDriver, tmp: Path, name: str, args: argparse.Namespace, pin: tuple[float, float] | None):
    seconds = (args.pinned_minutes if pin else args.minutes) * 60
    driver.fresh()
    stamps = tmp / f"{name}.stamps"
    stamps.write_text("")
    workers = Workers({**driver.worker_env(), "BENCH_LATENCY_FILE": str(stamps)}, tmp / f"{name}.log")
    send = driver.actors["stamp"].send
    pin_conn: psycopg.Connection | None = None
    try:
        # Ready: a first message comes back.
        send(time.time())
        if not wait_until(lambda: stamps.read_text().strip() != "", timeout=60, interval=0.05):
            raise RuntimeError(f"workers did not start; see {workers.log_path}")
        stamps.write_text("")
        time.sleep(1.0)
        start = time.monotonic()
        sampler = Sampler(driver.url, driver.schema, args.window, start, statements=args.statements)
        sampler.start()
        sent_at: list[float] = []  # monotonic offset of each send
        i = 0
        while True:
            now = time.monotonic() - start
            if now >= seconds:
                break
            if pin and pin_conn is None and now >= pin[0]:
                pin_conn = psycopg.connect(apps.pg_url(driver.url, "bench-soak-pin"))
                pin_conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                pin_conn.execute("SELECT count(*) FROM pg_class").fetchone()  # the snapshot: xmin pinned
                log(f"{name}: xmin pinned at {now:.0f} s")
            if pin and pin_conn is not None and not pin_conn.closed and now >= pin[1]:
                pin_conn.rollback()
                pin_conn.close()
                log(f"{name}: pin released at {now:.0f} s")
            due = i / args.rate
            if due > now:
                time.sleep(due - now)
            elif now - due > 1.0:  # more than a second behind: the rate is lost, do not burst
                i = int(now * args.rate)
            send(time.time())
            sent_at.append(time.monotonic() - start)
            i += 1
        sampler.stopping.set()
        sampler.join()
        total = len(sent_at)
        wait_until(lambda: len(stamps.read_text().splitlines()) >= total, timeout=120, interval=0.2)
    finally:
        if pin_conn is not None and not pin_conn.closed:
            pin_conn.close()
        workers.stop()
    lines = [line.split() for line in stamps.read_text().splitlines()]
    # Map each stamp to its window by its send time relative to the first send.
    sends = sorted(float(a) for a, _ in lines)
    wall0 = sends[0] - sent_at[0] if sends else 0.0
    windows = int(seconds // args.window)
    out: list[dict[str, Any]] = []
    for w in range(windows):
        lo, hi = w * args.window, (w + 1) * args.window
        lat = sorted((float(b) - float(a)) * 1000 for a, b in lines if lo <= float(a) - wall0 < hi)
        count = sum(1 for t in sent_at if lo <= t < hi)
        done = sum(1 for _, b in lines if lo <= float(b) - wall0 < hi)  # actor starts in the window
        sample = sampler.samples[w] if w < len(sampler.samples) else {}
        out.append(
            {
                "window": [lo, hi],
                "p50_ms": percentile(lat, 50) if lat else None,
                "p99_ms": percentile(lat, 99) if lat else None,
                "received": len(lat),
                "sent_per_s": count / args.window,
                "done_per_s": done / args.window,
                "pinned": bool(pin and lo < pin[1] and hi > pin[0]),
                **sample,
            }
        )
    started = {a for a, _ in lines}
    missing = total - len(started)
    clean = sorted((float(b) - float(a)) * 1000 for a, b in lines if pin and float(a) - wall0 < pin[0])
    return {
        "windows": out,
        "statements": by_statement(sampler.statements, out) if sampler.statements else None,
        "sent": total,
        "missing": missing,
        "ran_twice": len(lines) - len(started),
        "clean_p99_ms": percentile(clean, 99) if clean else None,
    }


def server_log(path: Path) -> dict[str, Any]:
    """What the server's own work cost (--statements' server logs it): each autovacuum of a message
    table (its elapsed and CPU seconds, pages scanned) and each checkpoint (buffers written, seconds)."""
    vacuums, checkpoints = [], []
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    for k, line in enumerate(lines):
        if "automatic vacuum of table" in line and ".message\"" in line:
            block = " ".join(lines[k : k + 12])
            usage = re.search(r"CPU: user: ([\d.]+) s, system: ([\d.]+) s, elapsed: ([\d.]+) s", block)
            pages = re.search(r"pages: \d+ removed, (\d+) remain, (\d+) scanned", block)
            removable = re.search(r"tuples: (\d+) removed, (\d+) remain, (\d+) are dead but not yet removable", block)
            vacuums.append(
                {
                    "at": line[:23],
                    "cpu_s": float(usage[1]) + float(usage[2]) if usage else None,
                    "elapsed_s": float(usage[3]) if usage else None,
                    "pages_scanned": int(pages[2]) if pages else None,
                    "dead_not_removable": int(removable[3]) if removable else None,
                }
            )
        elif "checkpoint complete" in line:
            written = re.search(r"wrote (\d+) buffers", line)
            total = re.search(r"total=([\d.]+) s", line)
            checkpoints.append(
                {"at": line[:23], "buffers": int(written[1]) if written else None, "total_s": float(total[1]) if total else None}
            )
    # The plans of statements that took 100 ms or more (auto_explain): the first and the last few.
    starts = [k for k, line in enumerate(lines) if "plan:" in line and "duration:" in line]
    plans = []
    for k in starts:
        end = k + 1
        while end < len(lines) and lines[end].startswith("\t") and end - k < 60:
            end += 1  # the plan's lines (continuations of the log entry)
        plans.append("\n".join(lines[k:end]))
    return {"autovacuums": vacuums, "checkpoints": checkpoints, "slow_plans": plans[:3] + plans[3:][-3:]}


def report_server_log(log: dict[str, Any]) -> None:
    print("\nautovacuum of the message table (server log): when, CPU s, elapsed s, pages scanned, dead not removable")
    for v in log["autovacuums"]:
        print(f"  {v['at']}  {v['cpu_s']}  {v['elapsed_s']}  {v['pages_scanned']}  {v['dead_not_removable']}")
    print(f"checkpoints: {len(log['checkpoints'])}: " + ", ".join(f"{c['buffers']} buffers {c['total_s']} s" for c in log["checkpoints"]))
    for plan in log.get("slow_plans", []):
        print("\nslow statement (auto_explain, 100 ms or more):\n" + plan)


def by_statement(snapshots: list[dict[int, tuple]], windows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per statement (the 10 with the most time under the pin), per window: calls per message sent,
    mean milliseconds and shared buffers (hit or read) per call, buffers read from outside shared_buffers
    per call.  What grows with the pin's length is what to look at (issue 41)."""
    deltas: list[dict[int, tuple[int, float, int, int]]] = []
    text: dict[int, str] = {}
    for before, after in zip(snapshots, snapshots[1:], strict=False):
        window = {}
        for queryid, (calls, ms, blocks, read, query) in after.items():
            b = before.get(queryid, (0, 0.0, 0, 0, ""))
            window[queryid] = (calls - b[0], ms - b[1], blocks - b[2], read - b[3])
            text[queryid] = query
        deltas.append(window)
    pinned = [d for d, w in zip(deltas, windows, strict=False) if w["pinned"]]
    total = {q: sum(d.get(q, (0, 0.0))[1] for d in pinned) for q in text}
    out = []
    for queryid in sorted(total, key=lambda q: -total[q])[:10]:
        per_window = []
        for d, w in zip(deltas, windows, strict=False):
            calls, ms, blocks, read = d.get(queryid, (0, 0.0, 0, 0))
            sent = max(w["sent_per_s"] * (w["window"][1] - w["window"][0]), 1.0)
            per_window.append(
                {
                    "calls_per_message": calls / sent,
                    "ms_per_call": ms / calls if calls else None,
                    "buffers_per_call": blocks / calls if calls else None,
                    "read_per_call": read / calls if calls else None,
                    "ms_per_message": ms / sent,
                }
            )
        out.append({"query": text[queryid], "pinned_ms": total[queryid], "windows": per_window})
    return out


def report_statements(run: dict[str, Any]) -> None:
    """The statements' trend: clean windows against the first and the last pinned ones and those after."""
    ws = run["windows"]
    marks = [k for k, w in enumerate(ws) if w["pinned"]]
    if not run.get("statements") or not marks:
        return
    picks = [("clean", list(range(marks[0]))), ("pin 1st", marks[:1]),
             ("pin mid", [marks[len(marks) // 2]]), ("pin last", marks[-1:]),
             ("after", list(range(marks[-1] + 1, len(ws))))]  # fmt: skip
    print("\nstatements (pg_stat_statements), per call: mean ms / shared buffers (hit+read) / read; ms per message sent")
    print(f"{'':<8}" + "".join(f"| {name:<28}" for name, _ in picks))
    for st in run["statements"]:
        cells = []
        for _, ks in picks:
            rows = [st["windows"][k] for k in ks if k < len(st["windows"]) and st["windows"][k]["ms_per_call"] is not None]
            if not rows:
                cells.append(f"| {'-':<28}")
                continue
            ms = sum(r["ms_per_call"] for r in rows) / len(rows)
            blocks = sum(r["buffers_per_call"] for r in rows) / len(rows)
            read = sum(r["read_per_call"] for r in rows) / len(rows)
            per_msg = sum(r["ms_per_message"] for r in rows) / len(rows)
            cells.append(f"| {ms:7.3f} {blocks:7.0f} {read:5.0f} {per_msg:6.3f} ")
        print(f"{st['pinned_ms'] / 1000:7.1f}s" + "".join(cells) + f"  {st['query'][:70]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=300.0, help="sends per second")
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the unpinned run")
    parser.add_argument("--pinned-minutes", type=float, default=5.0, help="length of the pinned run")
    parser.add_argument("--pin", default="120:240", help="seconds of the pinned run the xmin is held (from:to)")
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--runs", default="unpinned,pinned")
    parser.add_argument("--goal", action="store_true", help="the pinned soak alone: 200/s, 5 min clean, 30 min pinned, 5 after")
    parser.add_argument("--long", action="store_true", help="with --goal: the horizon pinned for 2 hours")
    parser.add_argument("--out", default="soak.json", help="file name under benchmarks/results")
    parser.add_argument(
        "--statements", action="store_true",
        help="on a server of its own with pg_stat_statements: every statement's cost per window",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.goal:
        pinned_for = 120 if args.long else 30
        args.runs, args.rate, args.window = "pinned", 200.0, 60.0
        args.pinned_minutes = 5 + pinned_for + 5
        args.pin = f"300:{300 + pinned_for * 60}"
    pin_from, pin_to = (float(x) for x in args.pin.split(":"))
    url = os.environ.get("BENCH_PG_URL") or apps.PG_URL
    server = None
    if args.statements:
        server, url = statements.own_server(
            shared_preload_libraries="pg_stat_statements,auto_explain",
            log_autovacuum_min_duration="0", log_checkpoints="on",
            **{"pg_stat_statements.track": "top", "auto_explain.log_min_duration": "100"},
        )  # fmt: skip
        os.environ["BENCH_PG_URL"] = url  # apps.make_broker's too
    runs = args.runs.split(",")
    out: dict[str, Any] = {"rate": args.rate, "window": args.window, "pin": [pin_from, pin_to]}
    out["load_start"] = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        driver = PostgresDriver(PLAN, tmp, url)
        try:
            out["postgresql"] = driver.versions()["postgresql"]["server_version"]
            for name in runs:
                log(f"{name}: {args.rate:g} sends/s")
                out[name] = soak(driver, tmp, name, args, (pin_from, pin_to) if name == "pinned" else None)
        finally:
            driver.close()
            driver.shutdown()
            if server is not None:
                out["server_log"] = server_log(Path(server.datadir) / "log")
                server.close()
    out["load_end"] = os.getloadavg()
    report(out, runs)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


def _cells(w: dict[str, Any] | None) -> str:
    if not w:
        return " " * 46
    p50 = f"{w['p50_ms']:.1f}" if w["p50_ms"] is not None else "-"
    p99 = f"{w['p99_ms']:.1f}" if w["p99_ms"] is not None else "-"
    mb = f"{w['mb']:.1f}" if "mb" in w else "-"
    dead = f"{w['dead']:,}" if "dead" in w else "-"
    mark = "*" if w["pinned"] else " "
    return f"{p50:>6} {p99:>7} {w['sent_per_s']:>5.0f} {w.get('done_per_s', 0):>5.0f} {mb:>6} {dead:>9}{mark}"


def goals(run: dict[str, Any], pin: tuple[float, float]) -> list[str]:
    """Issue 41's goals for a pinned run, each window against the clean phase before the pin.

    Throughput (actor starts a second) at least 95% of the clean windows' median in every window
    the pin covers; p99 (send to actor start) at most twice the clean phase's; nothing lost; dead
    tuples back to the clean phase's level within the windows after the release.
    """
    ws = run["windows"]
    clean = [w for w in ws if w["window"][1] <= pin[0]]
    pinned = [w for w in ws if w["pinned"]]
    after = [w for w in ws if w["window"][0] >= pin[1]]
    if not clean or not pinned:
        return ["no clean or no pinned window: nothing to compare"]
    rates = sorted(w["done_per_s"] for w in clean)
    rate = rates[len(rates) // 2]
    p99 = run["clean_p99_ms"]
    worst_rate = min(pinned, key=lambda w: w["done_per_s"])
    worst_p99 = max(pinned, key=lambda w: w["p99_ms"] or 0.0)
    dead_clean = max(w.get("dead", 0) for w in clean)
    back = next((w for w in after if w.get("dead", 0) <= max(dead_clean, 1_000) * 1.5), None)
    lines = [
        f"throughput: clean median {rate:.1f}/s; worst pinned window {worst_rate['done_per_s']:.1f}/s "
        f"({worst_rate['done_per_s'] / rate:.3f}x) at {worst_rate['window'][0]:.0f} s: "
        + ("met" if worst_rate["done_per_s"] >= 0.95 * rate else "NOT MET") + " (>= 0.95x)",
        f"p99: clean phase {p99:.1f} ms; worst pinned window {worst_p99['p99_ms']:.1f} ms "
        f"({worst_p99['p99_ms'] / p99:.2f}x) at {worst_p99['window'][0]:.0f} s: "
        + ("met" if worst_p99["p99_ms"] <= 2 * p99 else "NOT MET") + " (<= 2x)",
        f"lost: {run['missing']} never started, {run['ran_twice']} started twice: "
        + ("met" if run["missing"] == 0 else "NOT MET"),
    ]
    if after:
        sizes = f"size {clean[-1].get('mb', 0):.1f} MB before the pin, {max(w.get('mb', 0) for w in pinned):.1f} at most "
        sizes += f"under it, {after[-1].get('mb', 0):.1f} at the end"
        if "heap_mb" in after[-1]:  # (runs before 2026-12-07's evening did not sample the heap alone)
            sizes += f" (the heap {clean[-1]['heap_mb']:.1f} MB before the pin, {after[-1]['heap_mb']:.1f} at the end; the rest indexes)"
        if back is not None:
            lines.append(f"dead tuples back to the clean level ({dead_clean:,}) by {back['window'][1] - pin[1]:.0f} s after the release; {sizes}")
        else:
            lines.append(f"dead tuples NOT back to the clean level ({dead_clean:,}) by the end; {sizes}")
    return lines


def report(out: dict[str, Any], runs: list[str]) -> None:
    head = f"{'p50':>6} {'p99':>7} {'sent':>5} {'done':>5} {'MB':>6} {'dead':>9} "
    print(f"\nsoak at {out['rate']:g} sends/s, PostgreSQL {out['postgresql']}; latency ms from send() to actor start")
    print(f"{'window s':<10}" + "".join(f"| {name:<45}" for name in runs))
    print(f"{'':<10}" + "".join(f"| {head}" for _ in runs))
    longest = max(len(out[name]["windows"]) for name in runs)
    for k in range(longest):
        ws = [out[name]["windows"][k] if k < len(out[name]["windows"]) else None for name in runs]
        first = next(w for w in ws if w)
        label = f"{first['window'][0]:.0f}-{first['window'][1]:.0f}"
        print(f"{label:<10}" + "".join(f"| {_cells(w)}" for w in ws))
    for name in runs:
        r = out[name]
        unpinned = [w["p99_ms"] for w in r["windows"] if not w["pinned"] and w["p99_ms"] is not None]
        pinned = [w["p99_ms"] for w in r["windows"] if w["pinned"] and w["p99_ms"] is not None]
        line = f"{name}: {r['sent']:,} sent, {r['missing']} never started"
        if unpinned:
            line += f"; p99 unpinned windows max {max(unpinned):.1f} ms"
        if pinned:
            line += f", pinned windows max {max(pinned):.1f} ms ({max(pinned) / max(unpinned):.2f}x)"
        print(line)
        if name == "pinned":
            for text in goals(r, (out["pin"][0], out["pin"][1])):
                print(f"  {text}")
            report_statements(r)
    print("* = the xmin was pinned during (part of) the window; sent and done a second (done: actor starts)")
    print(f"load average {out['load_start'][0]:.1f} -> {out['load_end'][0]:.1f}")
    if out.get("server_log"):
        report_server_log(out["server_log"])


if __name__ == "__main__":
    raise SystemExit(main())
