"""ONNX variants, written next to ``model.onnx``: graph-optimised, dynamic INT8, static INT8.

- ``model.opt.onnx`` (``fp32-opt``): ONNX Runtime's graph optimisations, saved.
- ``model.int8-dynamic.onnx`` (``int8-dynamic``): weights INT8, activations quantised per
  batch at run time (``quantize_dynamic``).
- ``model.int8-static.onnx`` (``int8-static``): weights and activations INT8, activation ranges
  taken from a calibration set (``quantize_static``, QDQ format).

Quantisation starts from ``quant_pre_process``'s output (shape inference, and ONNX Runtime's
basic optimisations) where that step works on the model and the quantiser accepts it, else from
the model itself. Tensors that are not float (strings, integers) and operators the quantiser
does not know (the ``ai.onnx.ml`` ones) stay as they are; a variant with nothing quantised, or
that fails, is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tailserve.modelconfig import Variant
from tailserve.optimize.candidates import DYNAMIC, GRAPH, NAMES, STATIC, Candidate, Skipped
from tailserve.optimize.datasets import Arrays, Dataset

SOURCE = "model.onnx"
FILES = {
    GRAPH: "model.opt.onnx",
    DYNAMIC: "model.int8-dynamic.onnx",
    STATIC: "model.int8-static.onnx",
}
# x86 CPUs without VNNI multiply u8 x s8 pairs into saturating 16-bit sums; 7-bit weights keep
# those sums in range. The file may serve on another machine than the one that made it, so it
# is made for the CPUs of its kind, not for this one.
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
# Operators of a graph with something quantised in it.
_QUANTISED = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "Integer", "QLinear")

log = logging.getLogger(__name__)


def make_onnx_variants(
    version_dir: Path, kinds: Sequence[str], calibration: Dataset | None
) -> list[Candidate | Skipped]:
    # Absolute: pre-processing runs in another working folder (see _starting_points).
    version_dir = version_dir.resolve()
    source = version_dir / SOURCE
    targets = {kind: version_dir / FILES[kind] for kind in FILES}
    found: list[Candidate | Skipped] = []
    if GRAPH in kinds:
        found.append(_attempt(GRAPH, targets, lambda: _graph(source, targets[GRAPH])))
    quantised = [kind for kind in (DYNAMIC, STATIC) if kind in kinds]
    if not quantised:
        return found
    try:
        import onnx  # noqa: F401  (onnxruntime.quantization needs it)
    except ImportError:
        reason = "ONNX Runtime's quantiser needs the onnx package (the 'examples' extra)"
        return found + [Skipped(NAMES[kind], reason) for kind in quantised]
    with tempfile.TemporaryDirectory(prefix="tailserve-optimize-") as scratch:
        starts = _starting_points(source, Path(scratch))

        def dynamic() -> str:
            return _from_first(starts, targets[DYNAMIC], _dynamic)

        def static() -> str:
            if calibration is None:
                raise ValueError("no calibration inputs")
            feeds = _Feeds(source, calibration)
            return _from_first(starts, targets[STATIC], lambda at, to: _static(at, to, feeds))

        for kind, make in ((DYNAMIC, dynamic), (STATIC, static)):
            if kind in kinds:
                found.append(_attempt(kind, targets, make))
    return found


def _attempt(kind: str, targets: dict[str, Path], make: Callable[[], str]) -> Candidate | Skipped:
    name = NAMES[kind]
    try:
        with _quiet():
            note = make()
    except Exception as exc:
        # The quantiser and ONNX Runtime raise anything (AssertionError, RuntimeError, their
        # own Fail): whatever it is, this variant is not made and the others go on. A file
        # an earlier run made goes too, so no stale variant is measured or served.
        targets[kind].unlink(missing_ok=True)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return Skipped(name, f"{type(exc).__name__}: {reason[:300]}")
    return Candidate(Variant(name=name, artifact=FILES[kind]), made=True, note=note)


def _graph(source: Path, target: Path) -> str:
    import onnxruntime as ort

    options = ort.SessionOptions()
    # EXTENDED, not ALL: ALL adds layout changes (NCHWc) chosen for this machine's CPU, and a
    # model saved with them runs only where it was made. EXTENDED's fusions are contrib
    # operators every CPU build of ONNX Runtime has. The worker applies ALL when it loads.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(target)
    options.log_severity_level = 3
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    _loads(target)
    return "ONNX Runtime graph optimisations (extended level), saved"


def _dynamic(start: Path, target: Path) -> str:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # INT8 weights (u8 x s8: ONNX Runtime's fast path for MatMul and Gemm on CPU); UINT8
    # where the ONNX Runtime installed has no kernel for INT8 weights (older ConvInteger).
    for weight in (QuantType.QInt8, QuantType.QUInt8):
        quantize_dynamic(start, target, weight_type=weight, reduce_range=_X86)
        try:
            _loads(target)
        except Exception:
            if weight is QuantType.QUInt8:
                raise
            continue
        _check_quantised(target)
        return f"weights {weight.name}{_reduced()}, activations quantised per batch"
    raise AssertionError("unreachable")


def _static(start: Path, target: Path, feeds: _Feeds) -> str:
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    # QDQ is the format ONNX Runtime's CPU kernels are tuned for; u8 activations x s8 weights
    # on x86, s8 x s8 elsewhere (ARM), as its documentation recommends.
    activation = QuantType.QUInt8 if _X86 else QuantType.QInt8
    quantize_static(
        start,
        target,
        feeds.reader(),
        quant_format=QuantFormat.QDQ,
        activation_type=activation,
        weight_type=QuantType.QInt8,
        reduce_range=_X86,
    )
    _loads(target)
    _check_quantised(target)
    return (
        f"QDQ, activations {activation.name}, weights QInt8{_reduced()}, "
        f"calibrated on {feeds.batches} batches"
    )


def _reduced() -> str:
    return " (7-bit range)" if _X86 else ""


def _starting_points(source: Path, scratch: Path) -> list[tuple[Path, str]]:
    """Where quantisation starts: the pre-processed model (when that works), then the model."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    prepared = scratch / "model.pre.onnx"
    # quant_pre_process leaves a file in the working folder when symbolic shape inference
    # fails (sym_shape_infer_temp.onnx): it runs in the scratch folder.
    with contextlib.chdir(scratch):
        for skip_symbolic in (False, True):
            try:
                with _quiet():
                    quant_pre_process(source, prepared, skip_symbolic_shape=skip_symbolic)
            except Exception as exc:
                log.debug("quant_pre_process (skip_symbolic_shape=%s): %s", skip_symbolic, exc)
                continue
            how = "ONNX shape inference" if skip_symbolic else "symbolic shape inference"
            return [(prepared, f"pre-processed ({how})"), (source, "not pre-processed")]
    return [(source, "not pre-processed (quant_pre_process failed on it)")]


def _from_first(
    starts: list[tuple[Path, str]], target: Path, make: Callable[[Path, Path], str]
) -> str:
    """The variant made from the first starting point the quantiser accepts."""
    failure: Exception | None = None
    for start, how in starts:
        try:
            return f"{make(start, target)}; {how}"
        except Exception as exc:
            failure = exc
    assert failure is not None
    raise failure


def _loads(path: Path) -> None:
    """The file must load on a plain CPU build of ONNX Runtime."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _check_quantised(path: Path) -> None:
    import onnx

    ops = {node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node}
    if not any(marker in op for op in ops for marker in _QUANTISED):
        raise ValueError("no operator of the model could be quantised")


class _Feeds:
    """Calibration batches as ONNX Runtime takes them: each input in its graph's own type."""

    def __init__(self, source: Path, calibration: Dataset) -> None:
        import onnx
        from onnx import helper

        graph = onnx.load(str(source), load_external_data=False).graph
        initialisers = {tensor.name for tensor in graph.initializer}
        self._types: dict[str, np.dtype[Any]] = {
            node.name: np.dtype(helper.tensor_dtype_to_np_dtype(node.type.tensor_type.elem_type))
            for node in graph.input
            if node.name not in initialisers
        }
        self._batches = calibration.batches
        self.batches = len(calibration.batches)

    def reader(self) -> Any:
        from onnxruntime.quantization import CalibrationDataReader

        batches = self._iterate()

        class Reader(CalibrationDataReader):  # type: ignore[misc]
            def get_next(self) -> Arrays | None:
                return next(batches, None)

        return Reader()

    def _iterate(self) -> Iterator[Arrays]:
        for batch in self._batches:
            yield {
                name: _typed(array, self._types[name])
                for name, array in batch.items()
                if name in self._types
            }


def _typed(array: np.ndarray[Any, Any], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    if dtype.kind == "O":  # a string tensor: ONNX Runtime reads str objects, not bytes
        out = np.empty(array.shape, dtype=object)
        items = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.ravel()]
        out.reshape(-1)[:] = items
        return out
    return array.astype(dtype, copy=False)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """ONNX Runtime's quantiser logs advice through the root logger (run pre-processing,
    per-channel, ...) at warning level: the report says what was done instead."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)
