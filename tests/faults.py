"""The fault-injection table: each scenario that breaks something on purpose adds a row (faults
injected, runs, their end states, duplicates found), printed at the end of the session."""

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class FaultRow:
    fault: str
    injected: int
    runs: int
    statuses: Counter = field(default_factory=Counter)
    duplicates: int = 0
    # Workers that died (killed, or exited on their own) and were replaced, as a supervisor does.
    workers_replaced: int = 0


FAULT_TABLE: list[FaultRow] = []


def fault_report(row: FaultRow) -> FaultRow:
    FAULT_TABLE.append(row)
    return row


def fault_table_lines() -> list[str]:
    lines = [
        f"{'fault':<52} {'injected':>8} {'runs':>5} {'duplicates':>10} "
        f"{'workers replaced':>16}  end states"
    ]
    for row in FAULT_TABLE:
        statuses = ", ".join(f"{status} {count}" for status, count in sorted(row.statuses.items()))
        lines.append(
            f"{row.fault:<52} {row.injected:>8} {row.runs:>5} {row.duplicates:>10} "
            f"{row.workers_replaced:>16}  {statuses}"
        )
    return lines
