"""The result envelope keeps under its size limit whatever part of it is large, and never cuts
the statuses, the error category or the call it answers."""

import json

import pytest

from runs.tools.envelope import ENVELOPE_CUT_MARKER, Envelope, fit

LIMIT = 2048


def _envelope(**parts) -> Envelope:
    return Envelope(
        call_id="call_1",
        tool="report_read@1.0.0",
        protocol_status="ok",
        business_status="ok",
        **parts,
    )


def _size(envelope: Envelope) -> int:
    """Bytes of the envelope as compact JSON in UTF-8."""
    return len(
        json.dumps(
            envelope.as_dict(), separators=(",", ":"), ensure_ascii=False, default=str
        ).encode()
    )


def test_an_envelope_that_fits_is_kept_whole():
    envelope = _envelope(raw={"rows": [1, 2, 3]}, normalized={"count": 3})

    assert (
        fit(envelope, max_bytes=LIMIT).as_dict()
        == _envelope(raw={"rows": [1, 2, 3]}, normalized={"count": 3}).as_dict()
    )


def test_a_large_raw_response_is_cut_to_a_preview_first():
    rows = [{"row": index, "text": "x" * 40} for index in range(200)]

    envelope = fit(_envelope(raw={"rows": rows}, normalized={"count": 200}), max_bytes=LIMIT)

    assert _size(envelope) <= LIMIT
    assert envelope.truncated is True
    assert json.dumps({"rows": rows}).startswith(envelope.raw["preview"])
    assert envelope.raw["preview"]
    assert envelope.normalized == {"count": 200}


def test_a_preview_ends_after_a_whole_value_wherever_the_limit_falls():
    # given records whose names a viewer without clearance is not shown: a name cut in two
    # ("Zoë Br") is no name masking finds
    rows = [{"name": f"Zoë Brandt {index}", "age": 1000 + index} for index in range(100)]
    text = json.dumps({"rows": rows}, ensure_ascii=False)

    for limit in range(400, 3000, 7):
        envelope = fit(_envelope(raw={"rows": rows}), max_bytes=limit)

        # then the preview is the start of the JSON text, up to the end of a whole value (no
        # string, number or key cut), within the limit
        preview = envelope.raw["preview"]
        assert envelope.size() <= limit
        assert text.startswith(preview)
        assert preview.endswith(("{", "[")) or text[len(preview)] in ",]}"
        assert preview or limit < 500
        # and it is as long as the limit allows: what is left unused is less than one more
        # record would take in the envelope (as JSON text within JSON text)
        record = json.dumps(f", {json.dumps(rows[-1], ensure_ascii=False)}", ensure_ascii=False)
        assert limit - _size(envelope) < len(record.encode()) - len('""')


@pytest.mark.parametrize(
    "parts",
    [
        {"raw": {"ok": True}, "normalized": {"summary": "y" * 60_000}},
        {"error": {"category": "UPSTREAM_ERROR", "message": "z" * 60_000}},
        {
            "sources": [
                {"id": str(index), "reference": f"project:apollo/update:{index}"}
                for index in range(500)
            ]
        },
    ],
    ids=["normalized", "error-message", "references"],
)
def test_whatever_part_is_large_the_envelope_keeps_under_the_limit(parts):
    envelope = fit(_envelope(**parts), max_bytes=LIMIT)

    assert _size(envelope) <= LIMIT
    assert envelope.truncated is True
    assert (envelope.call_id, envelope.protocol_status, envelope.business_status) == (
        "call_1",
        "ok",
        "ok",
    )
    if "error" in parts:
        assert envelope.error["category"] == "UPSTREAM_ERROR"
    if "sources" in parts:
        assert envelope.sources == parts["sources"][: len(envelope.sources)]
        assert envelope.sources


# A message of one-, two-, three- and four-byte characters (UTF-8), a quote and a newline
# (two bytes each as JSON): wherever the limit falls, it falls inside some character's bytes.
LONG_MESSAGE = 'Upstream refused: naïve café 日本語 "quoted"\nline 🙂 ' * 400


def _failed(message: str) -> Envelope:
    return _envelope(error={"category": "UPSTREAM_ERROR", "message": message})


@pytest.mark.parametrize("limit", range(300, 1400, 13))
def test_a_long_error_message_is_cut_to_all_that_fits_with_a_marker(limit):
    # when an envelope whose error message alone is too large is fitted under `limit`
    envelope = fit(_failed(LONG_MESSAGE), max_bytes=limit)

    # then the message is the start of the original, whole characters only, marked as cut
    message = envelope.error["message"]
    assert message.endswith(ENVELOPE_CUT_MARKER)
    kept = message.removesuffix(ENVELOPE_CUT_MARKER)
    assert LONG_MESSAGE.startswith(kept)
    message.encode("utf-8")
    # and it is as long as the limit allows (in bytes of UTF-8 JSON, as the envelope is
    # stored): one more character would not fit
    assert _size(envelope) <= limit
    longer = LONG_MESSAGE[: len(kept) + 1] + ENVELOPE_CUT_MARKER
    envelope.error = {**envelope.error, "message": longer}
    assert _size(envelope) > limit
    assert (envelope.error["category"], envelope.truncated) == ("UPSTREAM_ERROR", True)


def test_an_error_message_that_fits_exactly_is_not_cut():
    # given a message whose envelope is exactly the limit
    limit = _size(_failed(LONG_MESSAGE[:500]))

    # then it is kept whole, unmarked; one byte less and it is cut
    assert (
        fit(_failed(LONG_MESSAGE[:500]), max_bytes=limit).error["message"] == (LONG_MESSAGE[:500])
    )
    cut = fit(_failed(LONG_MESSAGE[:500]), max_bytes=limit - 1).error["message"]
    assert cut.endswith(ENVELOPE_CUT_MARKER)
    assert LONG_MESSAGE.startswith(cut.removesuffix(ENVELOPE_CUT_MARKER))


@pytest.mark.parametrize(
    ("parts", "cut", "whole"),
    [
        (
            {"raw": {"location": "https://sso.example/login"}, "normalized": {"status": 302}},
            ["message"],
            ["raw", "normalized"],
        ),
        ({"raw": None, "normalized": None}, ["message"], ["raw", "normalized"]),
        (
            {"raw": {"rows": ["x" * 60] * 60}, "normalized": {"status": 500}},
            ["raw"],
            ["normalized"],
        ),
        (
            {"raw": {"rows": ["x" * 60] * 60}, "normalized": {"status": 500}},
            ["raw", "message"],
            ["normalized"],
        ),
    ],
    ids=[
        "small-parts-beside-a-long-message",
        "absent-parts",
        "raw-larger-than-the-message",
        "raw-and-message-both-too-large",
    ],
)
def test_the_largest_part_is_cut_first_and_small_ones_stay_whole(parts, cut, whole):
    # given a failed call's envelope, too large by its message or by its raw response
    message = "Upstream refused: " + "the gateway said no. " * (40 if "message" in cut else 5)
    envelope = _envelope(error={"category": "UPSTREAM_ERROR", "message": message}, **parts)
    assert _size(envelope) > 1000

    # when it is fitted
    fitted = fit(envelope, max_bytes=1000)

    # then only the largest part was cut; the others, absent ones included, are as they were
    assert _size(fitted) <= 1000
    assert fitted.truncated is True
    assert fitted.error["message"].endswith(ENVELOPE_CUT_MARKER) == ("message" in cut)
    assert ("preview" in (fitted.raw or {})) == ("raw" in cut)
    for part in whole:
        value = fitted.error["message"] if part == "message" else getattr(fitted, part)
        assert value == (message if part == "message" else parts[part])
    # and every part cut keeps a share of the room, none is cut to nothing for another
    if "raw" in cut:
        assert len(fitted.raw["preview"]) > 200
    if "message" in cut:
        assert len(fitted.error["message"]) > 200


def test_too_many_references_leave_small_parts_whole():
    # given a call whose small raw response and normalised fields fit, but not its references
    references = [{"id": str(index), "reference": f"report:{index}"} for index in range(200)]
    raw, normalized = {"location": "https://sso.example/login"}, {"status": 302}
    envelope = _envelope(raw=raw, normalized=normalized, sources=list(references))

    # when it is fitted
    fitted = fit(envelope, max_bytes=1000)

    # then only the last references go; the raw response and the normalised fields are whole
    assert _size(fitted) <= 1000
    assert (fitted.raw, fitted.normalized) == (raw, normalized)
    assert fitted.sources == references[: len(fitted.sources)]
    assert len(fitted.sources) > 20
