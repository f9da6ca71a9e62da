"""The reply memo's bookkeeping: bounded by bytes, oldest out first; digests of parts."""

from __future__ import annotations

import gc

from tailserve.cache.replies import Replay, ReplyMemo, digest


def _replay(body: bytes) -> Replay:
    return Replay(view=0, key="k", value=b"v", status=200, headers=[], body=body)


def test_it_holds_no_more_bytes_than_its_bound_dropping_the_oldest() -> None:
    one = _replay(b"x" * 100)
    memo = ReplyMemo(max_bytes=3 * one.size)
    for i in range(3):
        memo.put(bytes([i]), _replay(b"x" * 100))
    assert len(memo) == 3 and memo.bytes == 3 * one.size
    memo.put(b"\x09", _replay(b"x" * 100))
    assert len(memo) == 3 and memo.bytes <= memo.max_bytes
    assert memo.get(b"\x00") is None and memo.get(b"\x09") is not None
    memo.put(b"\x01", _replay(b"y" * 100))  # replaced in place: counted once
    assert len(memo) == 3 and memo.bytes == 3 * one.size
    memo.drop(b"\x01")
    assert memo.get(b"\x01") is None and memo.bytes == 2 * one.size


def test_a_reply_larger_than_the_whole_memo_is_not_kept() -> None:
    memo = ReplyMemo(max_bytes=1000)
    memo.put(b"a", _replay(b"x" * 2000))
    assert len(memo) == 0 and memo.bytes == 0


def test_digests_tell_parts_apart_however_they_would_run_together() -> None:
    assert digest(b"ab", b"c") != digest(b"a", b"bc")
    assert digest(b"m", b"", b"body") != digest(b"m", b"body", b"")
    assert digest(b"m", b"1", b"x") == digest(b"m", b"1", b"x")
    assert len(digest(b"x")) == 16


def test_the_l1_entry_it_holds_counts_against_its_bound() -> None:
    kept = Replay(view=0, key="k", value=b"v" * 5000, status=200, headers=[], body=b"x")
    assert kept.size > 5000
    memo = ReplyMemo(max_bytes=8000)
    memo.put(b"a", kept)
    memo.put(b"b", kept)
    assert len(memo) == 1 and memo.bytes <= 8000


def test_kept_entries_are_not_walked_by_the_garbage_collector() -> None:
    # Numbers and bytes only: the collector stops tracking an entry at its first collection,
    # so full collections do not walk the memo's entries (they did, two objects each).
    memo = ReplyMemo(max_bytes=1 << 20)
    key = digest(b"request")
    # Made here, so that nothing but the memo (and this frame) holds them.
    body, kind = bytes("{}", "ascii"), bytes("application/json", "ascii")
    memo.put(
        key,
        Replay(
            view=7, key="k", value=b"v", status=200, headers=[(b"content-type", kind)], body=body
        ),
    )
    # Each pass untracks one level: the header pairs, the tuple of them, the entry (in
    # service the young collections do this long before a full one).
    for _ in range(3):
        gc.collect()
    # The collector walks only what it tracks: nothing it walks holds the entry's body or its
    # headers (this frame's locals are not among what it tracks).
    assert gc.get_referrers(body, kind) == []
    replay = memo.get(key)
    assert replay is not None
    assert (replay.view, replay.key, replay.value, replay.status, replay.body) == (
        7,
        "k",
        b"v",
        200,
        b"{}",
    )
    assert replay.headers == [(b"content-type", b"application/json")]
