"""What the API fuzzer sent and got, printed at the end of the session."""

from collections import Counter

FUZZ_COUNTS: Counter = Counter()


def fuzz_count_lines() -> list[str]:
    counts = FUZZ_COUNTS
    classes = ", ".join(
        f"{status} {counts[status]}" for status in sorted(k for k in counts if k.endswith("xx"))
    )
    return [
        f"operations {len({k for k in counts if k.startswith('op ')})}, "
        f"cases {counts['positive'] + counts['negative']} "
        f"(positive {counts['positive']}, negative {counts['negative']}), "
        f"requests {counts['requests']} (one per role and case, or one without a token), "
        f"responses {classes}"
    ]
