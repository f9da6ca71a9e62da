"""PyTorch: a TorchScript module in ``model.pt`` (``torch.jit.save``), one per model instance.

``parameters`` in model.yaml (a variant's over the model's):

- ``compile``: ``script`` (default: the TorchScript module, frozen and optimised for inference
  where that works), ``none`` (the module as saved), or ``inductor`` (``torch.compile`` of the
  exported program in ``model.pt2``, from ``torch.export.save``: torch.compile takes no
  TorchScript). Compilation runs in ``load``, before warm-up; where it fails, the TorchScript
  module serves and one warning says why.
- ``compile_mode``: torch.compile's mode (``reduce-overhead`` on CUDA, ``default`` on the CPU).
- ``quantize: dynamic_int8``: the linear layers with int8 weights (the CPU only).
- ``pinned``: on CUDA, copy through reusable pinned host buffers on a copy stream (true), or
  with plain ``.to(device)`` and ``.cpu()`` (false, the default: for batches of a few kilobytes
  the streams and buffers cost more than they save; benchmarks/gpu_check.py measures both).
- ``jit_profiling``: TorchScript's profiling executor, which re-optimises for each new input
  shape (false: one plan for every shape).

The device follows ``instances.providers``: ``cuda`` before ``cpu`` serves on the GPU where
torch sees one. ``instances.intra_op_threads`` > 0 sets torch's intra-op thread count, which is
one for the whole process: the last model loaded sets it for every torch model in the worker.
Inputs go to ``forward`` by its argument names where they are model.yaml's, else in model.yaml's
order; outputs (a tensor, a tuple or a dict) come back as model.yaml's outputs, in its order.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tailserve.errors import InvalidInput, ModelExecutionError, ModelLoadError
from tailserve.runtimes.base import Arrays, IOSpec, RuntimeContext, Signature
from tailserve.runtimes.torch_cuda import PinnedTransfer, choose_device
from tailserve.tensors import numpy_dtype

log = logging.getLogger(__name__)

ARTIFACT = "model.pt"
EXPORTED = "model.pt2"
COMPILE = ("script", "none", "inductor")
QUANTIZE = ("dynamic_int8",)
# Dynamo and Inductor keep process-wide state: instances that load in parallel compile in turn.
_COMPILING = threading.Lock()


class TorchRuntime:
    steady = True  # compute alone: its time follows the batch's size

    def __init__(self, context: RuntimeContext) -> None:
        self.context = context
        self._where = context.where
        self._module: Any = None
        self._device = torch.device("cpu")
        self._order: list[str] = [spec.name for spec in context.config.inputs]
        self._outputs: list[str] = [spec.name for spec in context.config.outputs]
        self._transfer: PinnedTransfer | None = None
        # CUDA graphs: batches padded to these sizes, so a graph is recorded per size once.
        self._buckets: tuple[int, ...] = ()
        # CUDA graphs are kept per thread (torch's cudagraph trees): one thread runs them all.
        self._thread: ThreadPoolExecutor | None = None
        self.compiled = "none"  # what serves: none | script | inductor (for logs and tests)
        # TorchScript's profiling executor (parameters.jit_profiling): off, it runs one plan
        # for every shape; on, it profiles and re-optimises the graph for each new input shape
        # (on CUDA, fusing kernels), a few hundred milliseconds for each of the first dozen
        # batch sizes a worker sees.
        self._optimize = False

    # --- load ---------------------------------------------------------------------------------

    def load(self) -> None:
        config, where = self.context.config, self._where
        parameters = self.context.parameters
        mode = _choice(parameters, "compile", COMPILE, "script", where)
        quantize = _choice(parameters, "quantize", (None, *QUANTIZE), None, where)
        strings = [spec.name for spec in config.inputs if spec.datatype == "BYTES"]
        if strings:
            raise ModelLoadError(
                f"{where}: input {strings[0]!r} is BYTES, and torch takes no strings: give the "
                "model numbers (category indices, token ids) and declare them as such"
            )
        self._device = choose_device(config.instances.providers, where)
        cuda = self._device.type == "cuda"
        if quantize is not None and cuda:
            raise ModelLoadError(
                f"{where}: field 'parameters.quantize': dynamic_int8 has CPU kernels only; "
                "serve this variant with instances.providers [cpu], or leave quantize out"
            )
        if quantize is not None and mode == "inductor":
            raise ModelLoadError(
                f"{where}: field 'parameters.quantize': dynamic_int8 quantises the TorchScript "
                "module, and compile: inductor compiles model.pt2; choose one"
            )
        # Binary requests' arrays are read-only views of the body, which the model only reads.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        if config.instances.intra_op_threads > 0:
            torch.set_num_threads(config.instances.intra_op_threads)  # process-wide
        pinned = parameters.get("pinned", False)
        profiling = parameters.get("jit_profiling", False)
        for key, value in (("pinned", pinned), ("jit_profiling", profiling)):
            if not isinstance(value, bool):
                raise ModelLoadError(f"{where}: field 'parameters.{key}' must be true or false")
        self._optimize = profiling
        self._transfer = PinnedTransfer(self._device) if cuda and pinned else None
        if mode == "inductor" and self._inductor(parameters, cuda):
            return
        self._module, self._order = self._scripted(mode, quantize)
        self.compiled = "none" if mode == "none" else "script"
        self._run(self._example(2 if config.batched else 0))

    def _scripted(self, mode: str, quantize: str | None) -> tuple[Any, list[str]]:
        path = self._path(ARTIFACT)
        if not path.is_file():
            raise ModelLoadError(f"{self._where}: {path} not found")
        try:
            with _quiet():
                loaded = torch.jit.load(str(path), map_location=self._device)  # type: ignore[no-untyped-call]
            module = loaded.eval()
        except Exception as exc:
            raise ModelLoadError(f"{self._where}: cannot load {path}: {_first_line(exc)}") from exc
        arguments = [argument.name for argument in module.forward.schema.arguments[1:]]
        order = _argument_order(arguments, self.context, path)
        if quantize is not None:
            return quantize_dynamic_int8(module), order
        if mode == "script":
            module = _frozen(module, self._where)
        return module, order

    def _inductor(self, parameters: dict[str, Any], cuda: bool) -> bool:
        """Compile model.pt2 and run it at the shapes it serves; False (after one warning):
        the TorchScript module serves instead."""
        default_mode = "reduce-overhead" if cuda else "default"
        compile_mode = str(parameters.get("compile_mode", default_mode))
        path = self._path(EXPORTED)
        if not path.is_file():
            log.warning(
                "%s: compile: inductor needs %s (torch.export.save): serving model.pt as "
                "TorchScript",
                self._where,
                path,
            )
            return False
        batched = self.context.config.batched
        if cuda and compile_mode in ("reduce-overhead", "max-autotune"):
            self._buckets = _powers_of_two(self.context.config.max_batch_size) if batched else ()
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="torch-cuda-graphs")
        try:
            with _COMPILING:
                self._module, self._order = self._compiled(path, compile_mode)
                for rows in self._buckets or ((2, 1) if batched else (0,)):
                    # CUDA graph trees run a shape once, record it the second time, then
                    # replay: three runs leave each padded size recorded.
                    for _ in range(3 if self._buckets else 1):
                        self._run(self._example(rows))
        except ModelLoadError:
            raise
        except Exception as exc:
            log.warning(
                "%s: compile: inductor failed (%s: %s): serving model.pt as TorchScript",
                self._where,
                type(exc).__name__,
                _first_line(exc),
            )
            self._drop_compiled()
            return False
        self.compiled = "inductor"
        return True

    def _compiled(self, path: Path, compile_mode: str) -> tuple[Any, list[str]]:
        try:
            program = torch.export.load(str(path))
        except Exception as exc:
            raise ModelLoadError(f"{self._where}: cannot load {path}: {_first_line(exc)}") from exc
        if self._device.type != "cpu":
            from torch.export.passes import move_to_device_pass

            program = move_to_device_pass(program, self._device)
        module = program.module()
        order = _argument_order(list(program.graph_signature.user_inputs), self.context, path)
        # Freezing folds the weights into the graph (CPU: prepacked for oneDNN); it is an
        # option of mode "default", and options and another mode do not combine.
        if compile_mode == "default":
            compiled = torch.compile(module, dynamic=True, options={"freezing": True})
        else:
            compiled = torch.compile(module, dynamic=True, mode=compile_mode)
        return compiled, order

    def _drop_compiled(self) -> None:
        self._module, self._buckets = None, ()
        if self._thread is not None:
            self._thread.shutdown(wait=False)
            self._thread = None

    def _path(self, filename: str) -> Path:
        """The version folder's file: a variant's own where it names one of that kind (an
        exported program's name ends in .pt2)."""
        variant = self.context.variant
        named = variant.artifact if variant is not None else None
        if named is not None and named.endswith(".pt2") == filename.endswith(".pt2"):
            filename = named
        return self.context.version_dir / filename

    def _example(self, rows: int) -> Arrays:
        """A synthetic batch of ``rows`` (0: the model takes no batch), at each range's low."""
        arrays: Arrays = {}
        for spec in self.context.config.inputs:
            dims = [d if d > 0 else 1 for d in spec.shape]
            low = spec.range[0] if spec.range is not None else 0
            arrays[spec.name] = np.full(
                [rows, *dims] if rows else dims, low, numpy_dtype(spec.datatype)
            )
        return arrays

    # --- predict ------------------------------------------------------------------------------

    def describe(self) -> Signature:
        # TorchScript declares argument names but no dtypes or shapes: model.yaml is the source.
        return Signature(
            inputs=tuple(IOSpec(name) for name in self._order),
            outputs=tuple(IOSpec(name) for name in self._outputs),
        )

    def predict(self, inputs: Arrays) -> Arrays:
        if self._module is None:
            raise RuntimeError(f"{self._where}: not loaded")
        return self._run(inputs)

    def _run(self, inputs: Arrays) -> Arrays:
        if self._thread is not None:
            return self._thread.submit(self._forward, inputs).result()
        return self._forward(inputs)

    def _forward(self, inputs: Arrays) -> Arrays:
        config = self.context.config
        arrays = [self._array(name, inputs) for name in self._order]
        rows = _rows(arrays) if config.batched else None
        padded = _bucket(self._buckets, rows)
        with torch.inference_mode():
            if self._transfer is not None:
                tensors = self._transfer.inputs(arrays, padded)
            else:
                tensors = [_tensor(array, padded, self._device) for array in arrays]
            if self._buckets:
                torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
            try:
                with torch.jit.optimized_execution(self._optimize):  # type: ignore[attr-defined]
                    result = self._module(*tensors)
            except Exception as exc:
                raise ModelExecutionError(f"{self._where}: {_first_line(exc)}") from exc
            named = self._named(result)
            if self._transfer is not None:
                host = self._transfer.outputs(named)
            else:
                host = {name: tensor.cpu().numpy() for name, tensor in named.items()}
        return {
            spec.name: self._output(spec.name, host[spec.name], rows) for spec in config.outputs
        }

    def _array(self, name: str, inputs: Arrays) -> np.ndarray[Any, Any] | None:
        array = inputs.get(name)
        spec = self.context.config.input(name)
        if array is None:
            if spec is not None and spec.optional:
                return None
            raise InvalidInput(f"input {name!r} is missing")
        if spec is not None and array.dtype != (want := numpy_dtype(spec.datatype)):
            array = array.astype(want)
        return array

    def _named(self, result: Any) -> dict[str, torch.Tensor]:
        if isinstance(result, torch.Tensor):
            values: list[Any] = [result]
        elif isinstance(result, (tuple, list)):
            values = list(result)
        elif isinstance(result, dict):
            missing = [name for name in self._outputs if name not in result]
            if missing:
                raise ModelExecutionError(
                    f"{self._where}: the model returned no {missing[0]!r} (it returned "
                    f"{sorted(result)})"
                )
            values = [result[name] for name in self._outputs]
        else:
            raise ModelExecutionError(
                f"{self._where}: the model returned a {type(result).__name__}, not tensors"
            )
        if len(values) != len(self._outputs) or not all(
            isinstance(value, torch.Tensor) for value in values
        ):
            raise ModelExecutionError(
                f"{self._where}: the model returned {len(values)} values for the "
                f"{len(self._outputs)} outputs in model.yaml ({', '.join(self._outputs)})"
            )
        return dict(zip(self._outputs, values, strict=True))

    def _output(self, name: str, array: np.ndarray[Any, Any], rows: int | None) -> Any:
        spec = next(spec for spec in self.context.config.outputs if spec.name == name)
        if rows is not None:
            array = array[:rows]
            if -1 not in spec.shape:
                if array.size != rows * math.prod(spec.shape):
                    raise ModelExecutionError(
                        f"{self._where}: {tuple(array.shape)} from the model does not fit output "
                        f"{name!r} of shape {spec.shape}"
                    )
                array = array.reshape([rows, *spec.shape])
        return array.astype(numpy_dtype(spec.datatype), copy=False)

    def unload(self) -> None:
        self._drop_compiled()
        self._transfer = None


def quantize_dynamic_int8(module: Any) -> Any:
    """A TorchScript module with its linear layers quantised: int8 weights, activations
    quantised per batch.

    The eager ``quantize_dynamic`` swaps ``nn.Linear`` submodules, and a loaded TorchScript
    module has none (its children are script modules): it returns the module unchanged. The
    graph-mode pass rewrites ``aten::linear`` into ``quantized::linear_dynamic`` on the
    TorchScript graph itself, so one artifact serves both variants with no pickle."""
    from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic_jit

    with _quiet():
        return quantize_dynamic_jit(module, {"": default_dynamic_qconfig})  # type: ignore[no-untyped-call]


def _frozen(module: Any, where: str) -> Any:
    try:
        with _quiet():
            return torch.jit.optimize_for_inference(torch.jit.freeze(module))
    except Exception as exc:
        log.info("%s: serving the TorchScript module unfrozen: %s", where, _first_line(exc))
        return module


def _argument_order(arguments: list[str], context: RuntimeContext, path: Path) -> list[str]:
    """Inputs in ``forward``'s order: by name where its arguments are model.yaml's inputs,
    else by position in model.yaml's order."""
    wanted = [spec.name for spec in context.config.inputs]
    if set(wanted) <= set(arguments):
        order = arguments[: max(arguments.index(name) for name in wanted) + 1]
        unknown = [name for name in order if name not in wanted]
        if unknown:
            raise ModelLoadError(
                f"{context.where}: {path.name}'s forward takes {unknown[0]!r}, which is not an "
                "input in model.yaml"
            )
        return order
    if len(arguments) == len(wanted):
        return wanted
    raise ModelLoadError(
        f"{context.where}: {path.name}'s forward takes {len(arguments)} inputs "
        f"({', '.join(arguments)}) and model.yaml lists {len(wanted)} ({', '.join(wanted)})"
    )


def _choice(
    parameters: dict[str, Any], key: str, allowed: tuple[Any, ...], default: Any, where: str
) -> Any:
    value = parameters.get(key, default)
    if value not in allowed:
        known = ", ".join(str(a) for a in allowed if a is not None)
        raise ModelLoadError(f"{where}: field 'parameters.{key}': {value!r} is not one of {known}")
    return value


def _rows(arrays: list[np.ndarray[Any, Any] | None]) -> int:
    return next((len(array) for array in arrays if array is not None), 0)


def _bucket(buckets: tuple[int, ...], rows: int | None) -> int | None:
    if rows is None or not buckets:
        return rows
    return next((size for size in buckets if size >= rows), rows)


def _powers_of_two(largest: int) -> tuple[int, ...]:
    sizes = [1 << i for i in range(max(largest, 1).bit_length()) if 1 << i < largest]
    return (*sizes, max(largest, 1))


def _tensor(
    array: np.ndarray[Any, Any] | None, rows: int | None, device: torch.device
) -> torch.Tensor | None:
    if array is None:
        return None
    if rows is not None and rows > len(array):  # padded with copies of its first row
        array = np.concatenate([array, np.repeat(array[:1], rows - len(array), axis=0)])
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without the deprecation warnings of TorchScript and torch.ao.quantization (torch 2.13
    deprecates both for torch.export and torchao): a load-time concern, not a worker's log."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # (quantize_dynamic_jit reads every parameter's .grad, and torch warns about that.)
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor")
        yield


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
