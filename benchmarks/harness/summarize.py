"""One table of the harness's runs: per system and phase, what docs/performance.md reports.

    python benchmarks/harness/summarize.py RESULTS_DIR [RESULTS_DIR ...]

Each RESULTS_DIR is a run of the harness (``results/<run-id>``, printed as
``[harness] results at: ...``). It reads the run's ``summary.json``, written by
the harness itself, and prints a Markdown row per system and phase: the median
completion rate and enqueue rate, claim p99 (median and worst sample), the
deepest queue, and after a chaos span the harness's ``jobs_lost`` estimate and
time back to 90% of the baseline's completion rate.  Nothing here recomputes
the harness's figures; it only lays them side by side.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _metric(phase: dict[str, Any], name: str, key: str) -> float | None:
    value = phase.get("metrics", {}).get(name, {}).get(key)
    return None if value is None else float(value)


def _cell(value: float | None, fmt: str = "{:,.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def rows(run: Path) -> list[str]:
    summary = json.loads((run / "summary.json").read_text())
    systems: dict[str, Any] = summary.get("systems", summary)
    out = []
    for system, block in systems.items():
        if not isinstance(block, dict) or "phases" not in block:
            continue
        for label, phase in block["phases"].items():
            if phase.get("phase_type") == "warmup":
                continue
            lost = phase.get("jobs_lost")
            back = phase.get("chaos_recovery_time_s")
            out.append(
                "| "
                + " | ".join(
                    [
                        run.name,
                        system,
                        f"{label} ({phase.get('phase_type')})",
                        _cell(_metric(phase, "completion_rate", "median"), "{:,.1f}"),
                        _cell(_metric(phase, "enqueue_rate", "median"), "{:,.1f}"),
                        _cell(_metric(phase, "claim_p99_ms", "median"), "{:,.1f}"),
                        _cell(_metric(phase, "claim_p99_ms", "peak"), "{:,.1f}"),
                        _cell(_metric(phase, "queue_depth", "peak")),
                        _cell(lost),
                        _cell(back, "{:,.1f}"),
                    ]
                )
                + " |"
            )
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    print(
        "| run | system | phase | completions/s (median) | enqueues/s (median) | claim p99 ms (median) "
        "| claim p99 ms (worst) | queue depth (peak) | jobs_lost (estimate) | back to 90% s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in argv:
        for line in rows(Path(name)):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
