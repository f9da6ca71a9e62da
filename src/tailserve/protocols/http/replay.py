"""Answering an inference from the reply memo (cache/replies.py), before it is decoded.

A request asked again with the same bytes gets the reply encoded for it before, while L1 still
serves, fresh, the entry that reply was made from, under the version that would serve the
request now: an invalidation, an expiry or a new version sends it down the whole path again.
The memo is filled from the fresh L1 hits the data plane reports (`DataPlane.infer`'s
``on_hit``).
"""

from __future__ import annotations

from tailserve.cache import ModelView, ResultCache
from tailserve.cache.memory import Lookup
from tailserve.cache.replies import Replay, ReplyMemo, digest
from tailserve.engine.dataplane import DataPlane, Hit
from tailserve.engine.messages import InferRequest
from tailserve.engine.options import deadline_and_priority
from tailserve.errors import TailserveError
from tailserve.observability.trace_log import TraceRecorder
from tailserve.protocols.http.headers import HeaderOptions, Headers, Reply, request_options
from tailserve.transport.request import HttpRequest

# Bodies up to this size are looked up (a digest costs ~1 ms a MiB).
_MEMO_BODY_BYTES = 1024 * 1024


class Replayer:
    def __init__(
        self, dataplane: DataPlane, memo: ReplyMemo, recorder: TraceRecorder | None = None
    ) -> None:
        self._dataplane = dataplane
        self._memo = memo
        self._recorder = recorder

    def replayed(self, request: HttpRequest, options: HeaderOptions) -> Reply | None:
        """The reply kept for a request of the same bytes, if it may answer this one. Only for
        requests that would read the cache and whose headers the whole path would accept;
        one looked up has its `HttpRequest.memo_key`."""
        if options.cache_mode is not None and options.cache_mode != "use":
            return None
        body = request.raw_body
        cache = self._dataplane.cache
        if len(body) > _MEMO_BODY_BYTES or cache is None:
            return None
        params = request.params
        model, version = params["model"], params.get("version")
        try:
            served = self._dataplane.manager.get(model, version)
        except TailserveError:
            return None
        view = getattr(served, "cache", None)  # (a pipeline has no result cache)
        if view is None or not view.l1.enabled:
            return None
        key = request.memo_key = digest(
            model.encode(),
            (version or "").encode(),
            request.header(b"inference-header-content-length") or b"",
            request.header(b"content-encoding") or b"",
            body,
        )
        replay = self._memo.get(key)
        if replay is None:
            return None
        infer = InferRequest(model, [], version=version)
        try:
            request_options(request, infer, options)
            deadline_and_priority(served.config, infer)
        except TailserveError:
            return None  # the whole path answers it with its 4xx
        if not _still_served(cache, view, replay, model):
            self._memo.drop(key)
            self._memo.stale += 1
            return None
        self._memo.hits += 1
        if self._recorder is not None:
            self._recorder.record(
                request.method, request.path, request.headers, request.decoded_body()
            )
        return replay.status, replay.headers, replay.body

    def keep(self, request: HttpRequest, hit: Hit, headers: Headers, body: bytes) -> None:
        """Keep the reply to a request looked up (`replayed`) and answered by a fresh L1 hit."""
        if request.memo_key:
            replay = Replay(hit.view.serial, hit.key, hit.value, 200, headers, body)
            self._memo.put(request.memo_key, replay)


def _still_served(cache: ResultCache, view: ModelView, replay: Replay, model: str) -> bool:
    """Whether ``view`` is the version that answered and its L1 still holds, fresh, the entry
    ``replay`` was made from. Then counted as the L1 hit it is (and only then: a refused replay
    leaves the lookup to the whole path)."""
    if view.serial != replay.view:
        return False
    lookup, found = view.l1.peek(replay.key)
    if found is None or lookup is not Lookup.HIT or found[0] is not replay.value:
        return False
    view.l1.get(replay.key)
    cache.observer.on_lookup(model, "l1", lookup.value)
    return True
