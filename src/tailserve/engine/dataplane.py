"""The one data plane behind every protocol: health, metadata, inference and the repository.

HTTP (and later gRPC) endpoints convert their wire format to these calls and back; nothing here
knows a status code or a header.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from tailserve import __version__
from tailserve.engine.messages import InferRequest, InferResponse
from tailserve.errors import InvalidInput, ModelNotFound
from tailserve.repository.config import ModelConfig
from tailserve.repository.manager import ModelManager, ModelStatus
from tailserve.tensors import Tensor, numpy_dtype

EXTENSIONS = ["binary_tensor_data", "model_repository", "model_configuration"]


class DataPlane:
    def __init__(self, manager: ModelManager, *, strict_readiness: bool = False) -> None:
        self.manager = manager
        self._strict = strict_readiness
        self.initial_load_done = False
        self.draining = False

    # --- health and metadata ----------------------------------------------------------------

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        """Ready once the first load of every model has finished, and not shutting down.

        A model that failed to load keeps the server unready only with strict readiness; by
        default it is reported (model ready = false, repository index) and the rest serve.
        """
        if self.draining or not self.initial_load_done:
            return False
        states = self.manager.states()
        if self._strict:
            return all(state.ready for state in states)
        return all(state.ready or state.status is not ModelStatus.LOADING for state in states)

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "tailserve", "version": __version__, "extensions": EXTENSIONS}

    def model_ready(self, name: str, version: str | None = None) -> bool:
        state = self.manager.state(name)
        if version is None:
            return state.ready
        return state.ready and _as_int(version) in state.versions

    def model_metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        served = self.manager.get(name, version)
        state = self.manager.state(name)
        config = served.config
        return {
            "name": name,
            "versions": [str(v) for v in sorted(state.versions)],
            "platform": _platform(config),
            "inputs": [_tensor_metadata(config, spec) for spec in config.inputs],
            "outputs": [_tensor_metadata(config, spec) for spec in config.outputs],
        }

    def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        served = self.manager.get(name, version)
        config: dict[str, Any] = msgspec.to_builtins(served.config)
        return config

    # --- inference --------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        served = self.manager.get(request.model, request.version)
        config = served.config
        wanted = _wanted_outputs(config, request)
        checked = served.plan.check(request.inputs)
        outputs, stats = await served.scheduler.infer(checked.arrays, checked.rows, checked.group)
        tensors = []
        for name, spec_datatype, parameters in wanted:
            array = np.asarray(outputs[name], dtype=numpy_dtype(spec_datatype))
            tensors.append(Tensor(name, spec_datatype, array, parameters))
        return InferResponse(
            model=request.model,
            version=str(served.version),
            outputs=tensors,
            id=request.id,
            parameters={
                "model_version": str(served.version),
                "queue_us": int(stats.queue_s * 1e6),
                "compute_us": int(stats.compute_s * 1e6),
                "batch_size": stats.batch_size,
            },
        )

    # --- repository -------------------------------------------------------------------------

    def repository_index(self, *, ready_only: bool = False) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = []
        loaded = {state.name: state for state in self.manager.states()}
        for name in sorted(set(loaded) | set(self.manager.known_on_disk())):
            state = loaded.get(name)
            if state is None:
                entries.append({"name": name, "state": "UNAVAILABLE", "reason": "not loaded"})
                continue
            if state.versions:
                for version in sorted(state.versions):
                    entries.append({"name": name, "version": str(version), "state": "READY"})
            else:
                entries.append({"name": name, "state": state.status.value, "reason": state.reason})
        if ready_only:
            entries = [e for e in entries if e["state"] == "READY"]
        return entries

    async def load_model(self, name: str) -> None:
        await self.manager.load(name)

    async def unload_model(self, name: str) -> None:
        await self.manager.unload(name)


def _wanted_outputs(
    config: ModelConfig, request: InferRequest
) -> list[tuple[str, str, dict[str, Any]]]:
    declared = {spec.name: spec.datatype for spec in config.outputs}
    if request.outputs is None:
        return [(name, datatype, {}) for name, datatype in declared.items()]
    wanted = []
    for output in request.outputs:
        datatype = declared.get(output.name)
        if datatype is None:
            raise InvalidInput(
                f"model {config.name!r} has no output named {output.name!r} "
                f"(outputs: {', '.join(declared)})"
            )
        wanted.append((output.name, datatype, output.parameters))
    return wanted


def _tensor_metadata(config: ModelConfig, spec: Any) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": config.full_shape(spec)}


def _platform(config: ModelConfig) -> str:
    return {
        "onnx": "onnxruntime_onnx",
        "lightgbm": "lightgbm",
        "sklearn": "sklearn",
        "python": "python",
    }[config.runtime]


def _as_int(version: str) -> int:
    try:
        return int(version)
    except ValueError:
        raise ModelNotFound(f"model version must be a whole number, got {version!r}") from None
