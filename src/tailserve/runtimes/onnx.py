"""ONNX Runtime: ``model.onnx`` in one inference session per model instance.

On a GPU (``instances.providers: [cuda]``) a batch runs through I/O binding: the inputs are
bound from host memory (ORT copies them to the device), the outputs stay on the device until
one copy brings them all back, so no output is copied twice or allocated outside ORT's arena.
``parameters.io_binding`` (``auto``: on for CUDA and TensorRT; ``true``; ``false``) overrides it.

Memory: on the CPU a session runs without ORT's arena (``parameters.memory_arena``: ``auto``,
the default, is off on the CPU and on for CUDA and TensorRT; ``true``; ``false``). The arena
keeps, for the life of the session, the most a run ever needed: the largest warmed shape of
every variant and instance held at once (2.4 GB for the sentiment example's three 2 MB
variants). Without it a run's buffers go back to malloc at its end; glibc maps the large ones
afresh each run, which the worker makes cheaper with transparent huge pages (`tailserve
serve` starts with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

from tailserve.errors import InvalidInput, ModelLoadError
from tailserve.runtimes.base import Arrays, IOSpec, RuntimeContext, Signature
from tailserve.tensors import numpy_dtype

log = logging.getLogger(__name__)

ARTIFACT = "model.onnx"

PROVIDERS: dict[str, str] = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}

_DATATYPES: dict[str, str] = {
    "tensor(bool)": "BOOL",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}


@dataclass(frozen=True, slots=True)
class _Feed:
    name: str
    datatype: str | None
    dtype: np.dtype[Any] | None


class OnnxRuntime:
    steady = True  # compute alone: its time follows the batch's size

    def __init__(self, context: RuntimeContext) -> None:
        self.context = context
        self._where = context.where
        self._session: ort.InferenceSession | None = None
        self._feeds: tuple[_Feed, ...] = ()
        self._outputs: list[str] = [spec.name for spec in context.config.outputs]
        self._binding: _Binding | None = None  # None: session.run, the CPU's path
        self._run: Callable[[list[str], dict[str, Any], Any], list[Any]] = _unloaded

    def load(self) -> None:
        config = self.context.config
        path = self.context.artifact(ARTIFACT)
        options = ort.SessionOptions()
        options.intra_op_num_threads = config.instances.intra_op_threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Spinning intra-op threads burn a core between batches; on small shared machines that
        # core belongs to the event loop.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = choose_providers(config.instances.providers, self._where)
        arena = _switch(self.context.parameters, "memory_arena", self._where)
        if arena is None:
            arena = providers[0] != "CPUExecutionProvider"
        options.enable_cpu_mem_arena = arena
        try:
            session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
        except Exception as exc:
            raise ModelLoadError(f"{self._where}: cannot load {path}: {exc}") from exc
        graph_outputs = [node.name for node in session.get_outputs()]
        missing = [name for name in self._outputs if name not in graph_outputs]
        if missing:
            raise ModelLoadError(
                f"{self._where}: {path} has no output {missing[0]!r} (it has {graph_outputs})"
            )
        self._feeds = tuple(self._feed(node.name, node.type) for node in session.get_inputs())
        self._session = session
        self._run = _runner(session, providers[0])
        wanted = self.context.parameters.get("io_binding", "auto")
        device = _binding_device(session, wanted, self._where)
        if device is not None:
            self._binding = _Binding(session, self._outputs, device)

    def _feed(self, name: str, ort_type: str) -> _Feed:
        datatype = _DATATYPES.get(ort_type)
        dtype = numpy_dtype(datatype) if datatype is not None else None
        spec = self.context.config.input(name)
        if spec is not None and datatype is not None and not _castable(spec.datatype, datatype):
            raise ModelLoadError(
                f"{self._where}: input {name!r} is {spec.datatype} in model.yaml but the graph "
                f"wants {datatype}"
            )
        return _Feed(name, datatype, dtype)

    @property
    def memory_arena(self) -> bool:
        """Whether the session keeps ORT's CPU arena (``parameters.memory_arena``)."""
        return bool(self._loaded().get_session_options().enable_cpu_mem_arena)

    def describe(self) -> Signature:
        session = self._loaded()
        return Signature(
            inputs=tuple(_spec(node) for node in session.get_inputs()),
            outputs=tuple(_spec(node) for node in session.get_outputs()),
        )

    def predict(self, inputs: Arrays) -> Arrays:
        feed: dict[str, Any] = {}
        for spec in self._feeds:
            array = inputs.get(spec.name)
            if array is not None:
                feed[spec.name] = _convert(spec, array)
        if self._binding is not None:
            return self._binding.run(feed)
        results = self._run(self._outputs, feed, None)
        return dict(zip(self._outputs, results, strict=True))

    def unload(self) -> None:
        self._session = self._binding = None
        self._run = _unloaded

    def _loaded(self) -> ort.InferenceSession:
        if self._session is None:
            raise RuntimeError(f"{self._where}: not loaded")
        return self._session


class _Binding:
    """``session.run`` through I/O binding: inputs bound from host memory, outputs left on
    ``device`` ("cuda", or "cpu", where the path is the same with no copies) and copied back
    together. One binding is reused: an instance runs one batch at a time."""

    def __init__(self, session: ort.InferenceSession, outputs: list[str], device: str) -> None:
        self.device = device
        self._session = session
        self._outputs = outputs
        self._binding = session.io_binding()

    def run(self, feed: dict[str, Any]) -> dict[str, Any]:
        binding = self._binding
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        for name, array in feed.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name in self._outputs:
            binding.bind_output(name, self.device)
        binding.synchronize_inputs()
        self._session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        return dict(zip(self._outputs, binding.copy_outputs_to_cpu(), strict=True))


def _runner(
    session: ort.InferenceSession, provider: str
) -> Callable[[list[str], dict[str, Any], Any], list[Any]]:
    """How a batch is run: on the CPU, the session's own ``run``, past the checks its Python
    wrapper makes on every call (graph capture, the feed's names, the ownership of OrtValues;
    none applies to a feed of numpy arrays the input plan has checked): a few per cent of a
    small request's CPU. Elsewhere the wrapper's, which may fall back to another provider."""
    inner = getattr(session, "_sess", None)
    run: Callable[[list[str], dict[str, Any], Any], list[Any]] = session.run
    if provider == "CPUExecutionProvider" and inner is not None:
        run = inner.run
    return run


def _unloaded(outputs: list[str], feed: dict[str, Any], options: Any) -> list[Any]:
    raise RuntimeError("the model is not loaded")


def _switch(parameters: dict[str, Any], name: str, where: str) -> bool | None:
    """``parameters.<name>``: ``auto`` (None, the default), ``true`` or ``false``."""
    wanted = parameters.get(name, "auto")
    if wanted not in ("auto", True, False):
        raise ModelLoadError(
            f"{where}: field 'parameters.{name}': {wanted!r} is not auto, true or false"
        )
    return None if wanted == "auto" else bool(wanted)


def _binding_device(session: ort.InferenceSession, wanted: Any, where: str) -> str | None:
    """Where I/O binding leaves the outputs (None: no binding), by ``parameters.io_binding``."""
    _switch({"io_binding": wanted}, "io_binding", where)
    gpu = session.get_providers()[0] in ("CUDAExecutionProvider", "TensorrtExecutionProvider")
    if wanted is False or (wanted == "auto" and not gpu):
        return None
    strings = [node.name for node in session.get_inputs() if node.type == "tensor(string)"]
    if strings:
        # ORT binds no string tensor from Python; such a graph's string nodes run on the CPU.
        level = logging.WARNING if wanted is True else logging.INFO
        log.log(level, "%s: input %r is a string tensor: no I/O binding", where, strings[0])
        return None
    return "cuda" if gpu else "cpu"


def choose_providers(wanted: list[str], where: str) -> list[str]:
    """ORT provider names in preference order, skipping absent ones; CPU is always the last."""
    available = set(ort.get_available_providers())
    chosen: list[str] = []
    for name in wanted:
        provider = PROVIDERS.get(name.lower(), name)
        if provider not in PROVIDERS.values():
            known = ", ".join(PROVIDERS)
            raise ModelLoadError(
                f"{where}: field 'instances.providers': unknown provider {name!r} (known: {known})"
            )
        if provider not in available:
            log.warning("%s: execution provider %s is not available; skipped", where, provider)
        elif provider not in chosen:
            chosen.append(provider)
    if "CPUExecutionProvider" in chosen:
        chosen.remove("CPUExecutionProvider")
    return [*chosen, "CPUExecutionProvider"]


def _spec(node: Any) -> IOSpec:
    shape = tuple(dim if isinstance(dim, int) and dim >= 0 else -1 for dim in node.shape)
    return IOSpec(name=node.name, datatype=_DATATYPES.get(node.type), shape=shape)


def _castable(source: str, target: str) -> bool:
    """Whether data of OIP ``source`` feeds a graph input of ``target`` without losing meaning."""
    if source == target:
        return True
    if "BYTES" in (source, target) or "BOOL" in (source, target):
        return False
    kind, want = numpy_dtype(source).kind, numpy_dtype(target).kind
    # Width changes and signedness (bounds checked per batch), plus integers into floats.
    return kind == want or {kind, want} == {"i", "u"} or (kind in "iu" and want == "f")


def _convert(spec: _Feed, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if spec.datatype == "BYTES":
        return _strings(spec.name, array)
    if spec.dtype is None or array.dtype == spec.dtype:
        return array
    if array.dtype.kind in "OSU":
        raise InvalidInput(f"input {spec.name!r}: the model wants {spec.datatype}, got strings")
    want = spec.dtype
    if want.kind in "iu" and array.dtype.kind in "iu" and array.size:
        # astype wraps silently (2**40 as INT32); a value that does not fit is the client's error.
        info = np.iinfo(want)
        if array.min() < info.min or array.max() > info.max:
            raise InvalidInput(f"input {spec.name!r}: a value does not fit {spec.datatype}")
    return array.astype(want)


def _strings(name: str, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    # ORT reads an object array through str(), so b"annual" would arrive as "b'annual'".
    if array.dtype.kind == "U":
        return array
    flat = array.reshape(-1).tolist()
    if all(type(item) is str for item in flat):  # (JSON's texts: as they are)
        return array
    try:
        items = [item.decode("utf-8") if isinstance(item, bytes) else str(item) for item in flat]
    except UnicodeDecodeError:
        raise InvalidInput(f"input {name!r}: BYTES data is not valid UTF-8") from None
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out.reshape(array.shape)
