"""The bank's host side: requests' edits parsed once per distinct string."""

from interleaver.bank import ParsedArgs, RequestEdits


def test_requests_on_one_preset_share_one_parse_and_their_own_vectors_never_do(monkeypatch):
    parsed = []
    parse = RequestEdits.from_args.__func__
    monkeypatch.setattr(RequestEdits, "from_args", classmethod(lambda cls, d: parsed.append(d) or parse(cls, d)))
    cache = ParsedArgs()
    preset = RequestEdits([(0, 2.0, "both")]).to_args()
    first = cache(preset)
    assert cache(preset) is first and first.entries == [(0, 2.0, "both")] and len(parsed) == 1
    assert cache(RequestEdits().to_args()) is not None and cache(None) is None
    own = RequestEdits([(0, 1.0, "both")], inline=[("layers.0", 0, 1.0, "both", "AACAPw==")]).to_args()
    a, b = cache(own), cache(own)
    assert a is not b and a == b  # the worker appends each request's own stages to its entries
    assert cache({"entries": [[0, 1.0, "both"]]}).entries == [(0, 1.0, "both")]  # a dict: parsed, not kept
    n = len(parsed)
    for i in range(ParsedArgs._MAX + 5):
        cache(RequestEdits([(i, 1.0, "both")]).to_args())
    assert len(cache._seen) <= ParsedArgs._MAX and len(parsed) == n + ParsedArgs._MAX + 5
