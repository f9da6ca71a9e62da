"""A model version's reader of ModelInferRequests whose inputs' layout it has met before.

The general way (`service.decode_request`, then the data plane's `InputPlan.check`) reads each
input's name, datatype, shape and parameters from the message, makes an array and a tensor of
each buffer and checks each against its rule: about 28 µs for churn's nine inputs, where the
typed JSON decoder (`protocols.http.oip_typed`) takes 13. A client sends the same inputs (names,
datatypes, shapes, no parameters) call after call, only the raw buffers differing. So once
two recent requests of a layout have been read and checked the general way, the layout is
kept, and a later request whose ``inputs`` equal it (one comparison, in C) is read in one
pass by the layout (`protocols.layouts`): each datatype's buffers joined into one array and held
to their ranges at once, the inputs cut from it.

It reads only requests with ``raw_input_contents`` whose layout it keeps (the newest few a model
version has met; inputs with no parameters or typed contents). Anything it cannot judge exactly
as the general way would (a buffer of another length, a value out of range or not a number, a
BYTES item not allowed) goes the general way, which says what is wrong in the same words as
ever: a request is answered alike whichever way reads it; this one is only faster.
"""

from __future__ import annotations

from typing import Any

from tailserve.engine.validation import Checked, InputPlan
from tailserve.errors import InvalidInput
from tailserve.modelconfig import ModelConfig
from tailserve.protocols.grpc import schema
from tailserve.protocols.http.oip_typed import PerPlan
from tailserve.protocols.layouts import KEPT, SEEN, Layout, Recent, layout_of
from tailserve.tensors import Tensor

__all__ = ["KEPT", "SEEN", "LayoutReader", "reader_for"]


class LayoutReader:
    """One model version's kept layouts (`reader_for`)."""

    def __init__(self, config: ModelConfig, plan: InputPlan) -> None:
        self.plan = plan
        self._specs = {spec.name: spec for spec in config.inputs}
        # (each kept layout with a message of its own holding a copy of its inputs, compared
        # with each request's)
        self._layouts: list[tuple[Any, Layout]] = []
        self._recent = Recent()

    def read(self, message: Any) -> tuple[list[Tensor], Checked] | None:
        """A request of a kept layout's inputs, checked; None: the general way reads it."""
        raw = message.raw_input_contents
        if not raw:
            return None
        inputs = message.inputs
        for holder, layout in self._layouts:
            if inputs == holder.inputs:
                return layout.read(raw)
        return None

    def learn(self, message: Any, tensors: list[Tensor]) -> Checked | None:
        """``tensors``, read from ``message`` the general way, checked by the plan (None where
        they fail: the data plane checks them again and says why); a layout it can read is
        kept once a recent request has had it too."""
        try:
            checked = self.plan.check(tensors)
        except InvalidInput:
            return None
        if message.raw_input_contents and len(message.raw_input_contents) == len(tensors):
            signature = tuple((t.name, t.datatype, t.data.shape) for t in tensors)
            if not self._recent.repeats(signature):
                return checked
            if any(item.parameters or item.HasField("contents") for item in message.inputs):
                return checked
            layout = layout_of(tensors, checked, self._specs)
            if layout is not None:
                holder = schema.ModelInferRequest()
                holder.inputs.extend(message.inputs)
                self._layouts = [(holder, layout), *self._layouts[: KEPT - 1]]
        return checked


# The layout reader of a model version.
reader_for = PerPlan(LayoutReader)
