"""The output: the table, the chart, the sources and commit a result was measured on."""

from __future__ import annotations

import compileall
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .drivers import SEND_THREADS
from .plan import KINDS, PROCESSES, REPO, THREADS
from .sides import IMPORTS


# -- output ---------------------------------------------------------------------
def fmt(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _pair(latency: dict[str, float] | None) -> str | None:
    return None if latency is None else f"{latency['p50_ms']:.2f} / {latency['p99_ms']:.2f}"


def _after(latency: dict[str, float] | None) -> str | None:
    if latency is None or "after_send_p50_ms" not in latency:
        return None
    return f"{latency['after_send_p50_ms']:.2f} / {latency['after_send_p99_ms']:.2f}"


def table(out: dict[str, Any]) -> str:
    kinds = [k for k in KINDS if k in out["brokers"]]
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, key: Callable[[dict[str, Any]], Any], digits: int = 0) -> None:
        rows.append((label, [fmt(key(out["brokers"][k]), digits) for k in kinds]))

    row("single send() msg/s", lambda f: f.get("single_send_per_s"))
    row(f"send() from {SEND_THREADS} threads, msg/s in all", lambda f: f.get("threaded_send_per_s"))
    row("bulk enqueue msg/s", lambda f: f.get("bulk_enqueue_per_s"))
    row(f"drain {out['plan']['backlog'] // 1000}k backlog msg/s", lambda f: f.get("drain_per_s"))
    row("worker start-up s (not in drain)", lambda f: f.get("worker_startup_s"), 2)
    row("drain CPU us/msg, worker processes", lambda f: f.get("worker_cpu_us_per_msg"))
    row("drain CPU us/msg, broker server", lambda f: f.get("server_cpu_us_per_msg"))
    row("idle latency p50 ms", lambda f: f.get("latency", {}).get("p50_ms"), 2)
    row("idle latency p99 ms", lambda f: f.get("latency", {}).get("p99_ms"), 2)
    row("  of which the send() call, p50 ms", lambda f: f.get("latency", {}).get("send_call_p50_ms"), 2)
    row("from send() returning to actor start, p50 / p99 ms", lambda f: _after(f.get("latency")))
    row("idle latency p50 / p99 ms, relaxed sends", lambda f: _pair(f.get("latency_relaxed_enqueue")))
    row("peak worker RSS MB/process", lambda f: f.get("peak_rss_mb_per_process"), 1)
    row("DB connections/process", lambda f: f.get("connections_per_process"))
    names = {
        "postgres": "PostgresBroker (ours, durable)",
        "redis": "RedisBroker (no persistence)",
        "redis-aof": "RedisBroker, appendfsync always (durable)",
        "rabbitmq": "RabbitmqBroker (no confirms)",
        "rabbitmq-confirms": "RabbitmqBroker, publisher confirms (durable)",
    }
    lines = ["| figure | " + " | ".join(names[k] for k in kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    relaxed = out["brokers"].get("postgres", {}).get("single_send_relaxed_per_s")
    if relaxed:
        lines.append(f"| single send() msg/s, synchronous_commit=False | {fmt(relaxed)} |" + " - |" * (len(kinds) - 1))
    backlog = out.get("backlog")
    if backlog:
        lines += [
            "",
            "| ours, backlog | drain msg/s | peak RSS MB/process | connections/process"
            " | table+indexes with backlog | right after drain | after VACUUM | after compact() |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for n, f in backlog.items():
            lines.append(
                f"| {int(n):,} | {fmt(f['drain_per_s'])} | {fmt(max(f['peak_rss_mb_per_process'].values(), default=0), 1)} "
                f"| {max(f['peak_connections_per_process'].values(), default=0)} "
                f"| {f['size_with_backlog_bytes'] / 2**20:.1f} MB | {f['size_after_drain_bytes'] / 2**20:.1f} MB "
                f"| {f['size_after_vacuum_bytes'] / 2**20:.2f} MB "
                f"| {f.get('size_after_compact_bytes', 0) / 2**20:.2f} MB |"
            )
    floor = out.get("floors")
    if floor:
        lines += [
            "",
            "| floor on this machine (same run) | |",
            "|---|---|",
            f"| durable one-row INSERT, one-column table, in a loop | {fmt(floor['durable_insert_per_s'])} /s |",
            f"| the same INSERT paced like the idle-latency sends, p50 | {floor['durable_insert_paced_p50_ms']:.2f} ms |",
            "| durable one-row INSERT into our message table (its keys; no ON CONFLICT, no NOTIFY), in a loop"
            f" | {fmt(floor['durable_insert_message_table_per_s'])} /s |",
            "| the same INSERT with a NOTIFY in its statement (nobody listening), in a loop"
            f" | {fmt(floor['durable_insert_message_table_notify_per_s'])} /s |",
            f"| that INSERT from {SEND_THREADS} sessions at once, without / with the NOTIFY, in all"
            f" | {fmt(floor['durable_insert_message_table_threads_per_s'])} / "
            f"{fmt(floor['durable_insert_message_table_notify_threads_per_s'])} /s |",
            "| paced: that INSERT, then the row claimed by id from a second session (no disk wait), p50"
            f" | {floor['insert_then_claim_paced_p50_ms']:.2f} ms |",
            "| paced: that INSERT with a NOTIFY, the row claimed by a thread the notification woke, p50"
            f" | {floor['insert_notify_claim_paced_p50_ms']:.2f} ms |",
            "| paced: the same, until the claimed id is taken from a queue by a waiting worker thread, p50"
            f" | {floor['insert_notify_claim_handoff_paced_p50_ms']:.2f} ms |",
        ]
        alone = floor.get("dramatiq_alone")
        if alone:
            lines.append(
                f"| Dramatiq's worker alone ({THREADS} threads, StubBroker, no-op actor): drain, worker CPU per message"
                f" | {fmt(alone['per_s'])} /s, {alone['cpu_us_per_msg']:.0f} us |"
            )
            lines.append(
                f"| so no stock worker's drain beats ({PROCESSES} processes, {os.cpu_count()} cores)"
                f" | {fmt(alone['drain_ceiling_per_s'])} /s |"
            )
        for name, seconds in floor["import_s"].items():
            lines.append(f"| import {IMPORTS[name]} | {'not installed' if seconds is None else f'{seconds:.3f} s'} |")
        for name, seconds in floor.get("import_cpu_s", {}).items():
            lines.append(
                f"| a fresh interpreter's CPU (user + system) to import {IMPORTS[name]}, median"
                f" | {'not installed' if seconds is None else f'{seconds:.3f} s'} |"
            )
    lines += ["", "| target | measured | goal | met | best this machine allows |", "|---|---|---|---|---|"]
    for t in out["targets"]:
        value = "-" if t["value"] is None else (f"{t['value']:,.2f}" if t["unit"] != "msg/s" else f"{t['value']:,.0f}")
        goal = ("<= " if not t["higher_is_better"] else ">= ") + (
            f"{t['goal']:,}" if t["unit"] == "msg/s" else f"{t['goal']}"
        )
        met = {True: "yes", False: "**no**", None: "-"}[t["met"]]
        bound = "-" if t.get("bound") is None else f"{t['bound']:.2f} {t['unit']}"
        lines.append(f"| {t['target']} | {value} {t['unit']} | {goal} {t['unit']} | {met} | {bound} |")
    return "\n".join(lines)


def chart(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in KINDS if k in out["brokers"]]
    labels = {
        "postgres": "Postgres\n(ours)",
        "redis": "Redis",
        "redis-aof": "Redis\nAOF always",
        "rabbitmq": "RabbitMQ",
        "rabbitmq-confirms": "RabbitMQ\nconfirms",
    }
    colors = {
        "postgres": "#336791",
        "redis": "#d82c20",
        "redis-aof": "#8c1c13",
        "rabbitmq": "#ff6600",
        "rabbitmq-confirms": "#b34700",
    }
    b = out["brokers"]
    fig, axes = plt.subplots(2, 4, figsize=(22, 9))

    def bars(ax: Any, key: str, title: str, unit: str, digits: int = 0) -> None:
        values = [b[k].get(key) or 0 for k in kinds]
        ax.bar(range(len(kinds)), values, color=[colors[k] for k in kinds])
        ax.set_xticks(range(len(kinds)), [labels[k] for k in kinds], fontsize=8)
        for i, v in enumerate(values):
            ax.annotate(f"{v:,.{digits}f}", (i, v), ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(unit)

    bars(axes[0][0], "single_send_per_s", "single send() (ours, AOF, confirms: durable)", "messages/s")
    bars(axes[0][1], "threaded_send_per_s", f"send() from {SEND_THREADS} threads, in all", "messages/s")
    bars(axes[0][2], "bulk_enqueue_per_s", "bulk enqueue (best means each)", "messages/s")
    if "postgres" in b:
        axes[0][2].axhline(50_000, color="gray", ls="--", lw=1, label="target 50k/s")
        axes[0][2].legend(loc="upper right", fontsize=8)
    bars(axes[0][3], "drain_per_s", f"drain, {out['plan']['backlog']:,}-message backlog", "messages/s")
    bars(axes[1][1], "worker_startup_s", "worker start-up (to the first message)", "s", 2)

    ax = axes[1][0]
    width = 0.38
    for j, (key, name) in enumerate((("p50_ms", "p50"), ("p99_ms", "p99"))):
        values = [b[k].get("latency", {}).get(key) or 0 for k in kinds]
        xs = [i + (j - 0.5) * width for i in range(len(kinds))]
        ax.bar(xs, values, width, label=name, color=[colors[k] for k in kinds], alpha=1.0 if j == 0 else 0.55)
        for x, v in zip(xs, values, strict=True):
            ax.annotate(f"{v:.1f}", (x, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(kinds)), [labels[k] for k in kinds], fontsize=8)
    floor = (out.get("floors") or {}).get("insert_notify_claim_handoff_paced_p50_ms")
    if floor:
        ax.axhline(1.2 * floor, color="gray", ls="--", lw=1, label="target p50: 1.2x the floor")
    confirms = b.get("rabbitmq-confirms", {}).get("latency", {})
    if confirms:
        ax.axhline(2 * confirms["p99_ms"], color="gray", ls=":", lw=1, label="target p99: 2x RabbitMQ-confirms'")
    ax.set_yscale("log")
    ax.set_title(f"idle latency send->actor start ({out['plan']['latency_rate']:.0f} msg/s)")
    ax.set_ylabel("ms (log)")
    ax.legend(fontsize=8)

    backlog = out.get("backlog")
    if backlog:
        ns = list(backlog)
        ax = axes[1][2]
        rates = [backlog[n]["drain_per_s"] for n in ns]
        ax.bar([f"{int(n):,}" for n in ns], rates, color=colors["postgres"])
        for i, v in enumerate(rates):
            ax.annotate(f"{v:,.0f}", (i, v), ha="center", va="bottom", fontsize=9)
        ax.set_title("ours: drain rate by backlog size")
        ax.set_ylabel("messages/s")
        ax.set_xlabel("backlog (messages)")

        ax = axes[1][3]
        rss = [max(backlog[n]["peak_rss_mb_per_process"].values(), default=0) for n in ns]
        sizes = [backlog[n]["size_with_backlog_bytes"] / 2**20 for n in ns]
        after = [backlog[n].get("size_after_compact_bytes", backlog[n]["size_after_vacuum_bytes"]) / 2**20 for n in ns]
        xs = list(range(len(ns)))
        ax.bar([x - 0.27 for x in xs], rss, 0.27, label="peak worker RSS/process", color="#6a994e")
        ax.bar(xs, sizes, 0.27, label="table+indexes with backlog", color="#bc6c25")
        ax.bar([x + 0.27 for x in xs], after, 0.27, label="table+indexes drained, compacted", color="#dda15e")
        ax.set_xticks(xs, [f"{int(n):,}" for n in ns])
        ax.set_title("ours: memory and table size")
        ax.set_ylabel("MB")
        ax.set_xlabel("backlog (messages)")
        ax.legend(fontsize=8, loc="upper left")
        ax.set_ylim(0, max(rss + sizes) * 1.35)
    else:
        axes[1][2].axis("off")
        axes[1][3].axis("off")

    meta = out["meta"]
    fig.suptitle(
        f"dramatiq-pg-fenced benchmark ({out['plan']['name']}): {PROCESSES} worker processes x {THREADS} threads, "
        f"{meta['cpus']} CPUs, load avg at start {meta['loadavg_start'][0]:.2f}, {meta['started']}"
        + (", ours on a PostgreSQL server of its own" if meta.get("pg_server", "").startswith("own") else ""),
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compile_sources() -> list[str]:
    """Byte-compile this checkout's package and the benchmark's app module, as ``pip install``
    compiles an installed wheel (and as the other brokers' packages are, in site-packages).

    An editable checkout has no ``.pyc`` files, and with ``PYTHONDONTWRITEBYTECODE`` set none
    are ever written: every worker process would compile our modules from source at start-up
    (about 25-40 ms per process here), which a user of the package never pays.
    """
    done = []
    # The package's folders too (its layers: core/, db/, ...); only the benchmark's own modules of benchmarks/.
    for path, levels in ((REPO / "dramatiq_pg_fenced", None), (REPO / "benchmarks", 0)):
        if compileall.compile_dir(str(path), quiet=1, maxlevels=levels):
            done.append(str(path.relative_to(REPO)))
    return done


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
