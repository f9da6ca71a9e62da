"""HTTP/2 frames read from raw bytes (hyperframe's), for tests that look under a client."""

from __future__ import annotations

from hyperframe.frame import Frame


def parse(data: bytes) -> list[Frame]:
    """Every whole frame in ``data``, in order."""
    frames = []
    while len(data) >= 9:
        frame, length = Frame.parse_frame_header(memoryview(data[:9]))
        frame.parse_body(memoryview(data[9 : 9 + length]))
        frames.append(frame)
        data = data[9 + length :]
    return frames
