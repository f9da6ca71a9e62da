"""A model version's reader of HTTP binary-extension requests whose JSON header it has met.

A binary request (`Inference-Header-Content-Length`) is a JSON header naming each input's
datatype, shape and `binary_data_size`, then the inputs' raw bytes. A client sends the same
header request after request, only the bytes after it differing. The general way
(`oip.decode_request`, then the model's `InputPlan.check`) reads the header, makes an array and
a tensor of each buffer and checks each: about 36 µs for churn's nine inputs. Once a header has
come twice among recent requests read that way, its layout (`protocols.layouts`) is kept under
the header's exact bytes, and a later request with that header is read in one pass: the buffers
cut at the offsets the header fixes, each datatype's joined into one array and held to the
ranges at once, the inputs cut from it as views, the checked arrays handed on.

It reads only requests whose header it keeps byte for byte (a header with an id that changes
each request never repeats: the general way reads those), every input sent as binary data with
no other parameter, the body exactly as long as the header says. Anything it cannot judge
exactly as the general way would (a value out of range or not a number, a BYTES item not allowed
or not all there) goes the general way, which says what is wrong in the same words as ever: a
request is answered alike whichever way reads it; this one is only faster.
"""

from __future__ import annotations

import threading

from tailserve.engine.messages import InferRequest
from tailserve.engine.validation import InputPlan
from tailserve.errors import InvalidInput
from tailserve.modelconfig import ModelConfig
from tailserve.protocols.http import oip
from tailserve.protocols.http.oip_typed import PerPlan
from tailserve.protocols.layouts import Layout, Recent, layout_of

# The headers a model version keeps (a dict lookup finds one, so more than gRPC's comparisons
# allow): BYTES inputs' sizes are in the header, so one client's few allowed values already
# make several (churn's two BYTES inputs: nine).
KEPT = 32
# The headers of recent requests read the general way; one is kept when it comes again.
SEEN = 32
# A longer header is never remembered (what is kept is bounded: 64 headers at most).
LONGEST = 64 * 1024


class _Kept:
    __slots__ = ("layout", "length", "spans")

    def __init__(self, layout: Layout, spans: list[tuple[int, int]], length: int) -> None:
        self.layout = layout
        self.spans = spans  # (each input's bytes in the body)
        self.length = length  # (the whole body's)


class BinaryReader:
    """One model version's kept headers (`reader_for`)."""

    def __init__(self, config: ModelConfig, plan: InputPlan) -> None:
        self.plan = plan
        self._specs = {spec.name: spec for spec in config.inputs}
        self._kept: dict[bytes, _Kept] = {}
        self._recent = Recent(SEEN)
        # (a large body is read on a thread of its own: learning there and on the event loop
        # at once must not race on what is remembered; reading only looks a header up)
        self._learning = threading.Lock()

    def decode(
        self, model: str, version: str | None, body: bytes, header_length: int
    ) -> InferRequest:
        """The request: read by its header's layout where it is kept, else the general way
        (which raises what is wrong), its header then learnt."""
        found = self.read(model, version, body, header_length)
        if found is not None:
            return found
        request = oip.decode_request(model, version, body, header_length)
        self.learn(body, header_length, request)
        return request

    def read(
        self, model: str, version: str | None, body: bytes, header_length: int
    ) -> InferRequest | None:
        """The request, its inputs checked, where its header is kept; None: the general way
        reads it."""
        if type(body) is not bytes:  # (a layout reads bytes; anything else the general way)
            return None
        header = body[:header_length]
        kept = self._kept.get(header)
        if kept is None or len(body) != kept.length:
            return None
        found = kept.layout.read([body[start:end] for start, end in kept.spans])
        if found is None:
            return None
        tensors, checked = found
        try:
            request = oip.request_of(model, version, oip.read_header(header), tensors)
        except InvalidInput:  # (a header of a request that was read: never, but say so there)
            return None
        request.checked = (self.plan, checked)
        return request

    def keeps(self, header: bytes) -> bool:
        """Whether requests with this header are read by its layout."""
        return header in self._kept

    def learn(self, body: bytes, header_length: int, request: InferRequest) -> None:
        """``request``, read from ``body`` the general way: its inputs checked by the plan
        (left unchecked where they fail: the data plane checks them again and says why); its
        header kept once a recent request has had it too."""
        try:
            checked = self.plan.check(request.inputs)
        except InvalidInput:
            return
        request.checked = (self.plan, checked)
        if type(body) is not bytes or header_length > LONGEST:
            return
        header = body[:header_length]
        with self._learning:
            if not self._recent.repeats(header):
                return
            spans = _spans(request, header_length, len(body))
            if spans is None:
                return
            layout = layout_of(request.inputs, checked, self._specs)
            if layout is None:
                return
            if len(self._kept) >= KEPT:
                del self._kept[next(iter(self._kept))]
            self._kept[header] = _Kept(layout, spans, len(body))


def _spans(request: InferRequest, start: int, length: int) -> list[tuple[int, int]] | None:
    """Where each input's bytes lie in a body of ``length`` whose header ends at ``start``;
    None unless every input came as binary data with no other parameter and they fill the
    body."""
    spans = []
    for tensor in request.inputs:
        size = tensor.parameters.get("binary_data_size")
        if len(tensor.parameters) != 1 or type(size) is not int:
            return None
        spans.append((start, start + size))
        start += size
    return spans if start == length else None


# The binary reader of a model version.
reader_for = PerPlan(BinaryReader)
