"""Small server-rendered SVG charts: no script, no external asset; labels are escaped."""

from collections.abc import Sequence
from datetime import date
from decimal import Decimal

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

NO_DATA = mark_safe("<p>No data.</p>")

PALETTE = (
    "#2f7d4f", "#4a7bd0", "#c9a227", "#c94a4a", "#7b5ea7", "#3a9fb0", "#d07a2f", "#666666",
)  # fmt: skip


def bars(
    series: Sequence[tuple[str, float | Decimal]], *, unit: str = "", width: int = 640
) -> SafeString:
    """Horizontal bars, one per (label, value), each value written as given: a Decimal
    (money) keeps its digits, where a float would show a small one as 2e-05."""
    if not series:
        return NO_DATA
    top = max(value for _, value in series) or 1
    row = 22
    return format_html(
        '<svg role="img" width="{}" height="{}" viewBox="0 0 {} {}">{}</svg>',
        width,
        row * len(series),
        width,
        row * len(series),
        format_html_join(
            "",
            '<text x="0" y="{}" font-size="12">{}</text>'
            '<rect x="200" y="{}" width="{}" height="14" fill="{}"></rect>'
            '<text x="{}" y="{}" font-size="12">{}{}</text>',
            (
                (
                    index * row + 14,
                    label,
                    index * row + 3,
                    round((width - 280) * value / top, 1),
                    PALETTE[1],
                    205 + round((width - 280) * value / top, 1),
                    index * row + 14,
                    value,
                    unit,
                )
                for index, (label, value) in enumerate(series)
            ),
        ),
    )


def stacked_columns(
    days: Sequence[date], series: dict[str, dict[date, float]], *, height: int = 160
) -> SafeString:
    """One column per day, stacked by series, with a legend."""
    if not series:
        return NO_DATA
    names = sorted(series)
    totals = [sum(series[name].get(day, 0) for name in names) for day in days]
    top = max(totals) or 1
    column = 36
    rects = []
    for index, day in enumerate(days):
        base = height
        for color, name in enumerate(names):
            value = series[name].get(day, 0)
            if not value:
                continue
            size = round(height * value / top, 1)
            base -= size
            rects.append(
                (index * column + 4, base, size, PALETTE[color % len(PALETTE)], name, value)
            )
    legend = format_html_join(
        " ",
        '<span style="color:{}">■ {}</span>',
        ((PALETTE[color % len(PALETTE)], name) for color, name in enumerate(names)),
    )
    labels = format_html_join(
        "",
        '<text x="{}" y="{}" font-size="10">{}</text>',
        (
            (index * column + 4, height + 14, day.strftime("%m-%d"))
            for index, day in enumerate(days)
        ),
    )
    return format_html(
        '<svg role="img" width="{}" height="{}">{}{}</svg><p>{}</p>',
        column * len(days),
        height + 20,
        format_html_join(
            "",
            '<rect x="{}" y="{}" width="28" height="{}" fill="{}"><title>{}: {}</title></rect>',
            rects,
        ),
        labels,
        legend,
    )
