"""The torch runtime against real TorchScript and exported modules: predictions, variants,
compilation and its fallback, load errors, and the CPU when CUDA is asked for but absent."""

# No `from __future__ import annotations`: TorchScript reads the modules' annotations as objects.

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tailserve.engine.buckets import BucketRule
from tailserve.engine.validation import InputPlan
from tailserve.engine.warmup import load_and_warm
from tailserve.errors import InvalidInput, ModelLoadError
from tailserve.examples.churn import sample_inputs
from tailserve.examples.churn_torch import INPUTS, MODEL, auc, write_churn_torch
from tailserve.modelconfig import ModelConfig, load_model_config, parse_model_config
from tailserve.runtimes import RuntimeContext, create_runtime
from tailserve.runtimes.torch import TorchRuntime

OUTPUT = "churn_probability"
# torch 2.13 deprecates TorchScript (for torch.export), which these tests still write.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The churn_torch example model folder (trained once for the module)."""
    directory = tmp_path_factory.mktemp("torch-examples")
    write_churn_torch(directory)
    return directory / MODEL


@pytest.fixture(autouse=True)
def keep_threads() -> Any:
    threads = torch.get_num_threads()  # process-wide: a model's load sets it
    yield
    torch.set_num_threads(threads)


def customers(rows: int, seed: int = 5) -> dict[str, np.ndarray[Any, Any]]:
    full = sample_inputs(rows, seed=seed)
    return {field.name: full[field.name] for field in INPUTS}


def loaded(model_dir: Path, variant: str | None = None, **parameters: Any) -> TorchRuntime:
    config = load_model_config(model_dir)
    if parameters:
        config = parse_model_config({**raw(config), "parameters": parameters}, source="test")
    chosen = next((v for v in config.variants.choices if v.name == variant), None)
    runtime = create_runtime(RuntimeContext(config, 1, model_dir / "1", chosen))
    assert isinstance(runtime, TorchRuntime)
    runtime.load()
    return runtime


def raw(config: ModelConfig) -> dict[str, Any]:
    import msgspec

    return dict(msgspec.to_builtins(config))


def test_the_example_predicts_its_outputs_by_name_with_model_yamls_dtypes(example: Path) -> None:
    runtime = loaded(example)
    assert runtime.compiled == "script"
    signature = runtime.describe()
    assert [spec.name for spec in signature.inputs] == [field.name for field in INPUTS]
    assert [(spec.name, spec.datatype) for spec in signature.outputs] == [(OUTPUT, None)]
    out = runtime.predict(customers(300))
    assert list(out) == [OUTPUT]
    assert out[OUTPUT].shape == (300, 1) and out[OUTPUT].dtype == np.float32
    assert out[OUTPUT].min() >= 0.0 and out[OUTPUT].max() <= 1.0
    # One row at a time gives the batch's answers.
    one = runtime.predict({name: array[:1] for name, array in customers(300).items()})
    np.testing.assert_allclose(one[OUTPUT], out[OUTPUT][:1], atol=1e-5)
    runtime.unload()
    with pytest.raises(RuntimeError, match="not loaded"):
        runtime.predict(customers(1))


def test_the_int8_variant_is_close_to_fp32_and_as_good(example: Path) -> None:
    config = load_model_config(example)
    assert [v.name for v in config.variants.choices] == ["fp32", "int8"]
    fp32 = loaded(example, "fp32").predict(customers(2000))[OUTPUT]
    int8 = loaded(example, "int8").predict(customers(2000))[OUTPUT]
    assert float(np.abs(fp32 - int8).max()) < 0.05
    assert not np.array_equal(fp32, int8)  # it did quantise
    accuracy = {v.name: v.accuracy for v in config.variants.choices}
    assert accuracy["fp32"] is not None and accuracy["fp32"] > 0.7
    assert accuracy["int8"] is not None and accuracy["int8"] > accuracy["fp32"] - 0.01


def test_inductor_compiles_before_warm_up_and_the_warm_up_seeds_no_compile_time(
    example: Path,
) -> None:
    config = parse_model_config(
        {**raw(load_model_config(example)), "parameters": {"compile": "inductor"}}, source="test"
    )
    context = RuntimeContext(config, 1, example / "1")
    runtime, timings = load_and_warm(context, InputPlan(config), BucketRule(config, classes=True))
    assert isinstance(runtime, TorchRuntime)
    assert runtime.compiled == "inductor"  # gcc is here; elsewhere see the fallback test
    # Seconds went into compiling; the warm-up's seeds are a batch's milliseconds.
    assert sorted(rows for _, rows, _ in timings) == [1, 16, 256]
    assert all(seconds < 0.25 for _, _, seconds in timings)
    scripted = loaded(example).predict(customers(64))[OUTPUT]
    np.testing.assert_allclose(runtime.predict(customers(64))[OUTPUT], scripted, atol=1e-4)


def test_inductor_with_no_c_compiler_falls_back_to_torchscript_with_one_warning(
    example: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import torch._inductor.config as inductor

    with (
        inductor.patch({"cpp.cxx": ("/nonexistent/cc",), "fx_graph_cache": False}),
        caplog.at_level(logging.WARNING, "tailserve.runtimes.torch"),
    ):
        runtime = loaded(example, compile="inductor")
    assert runtime.compiled == "script"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "compile: inductor failed" in warnings[0]
    assert "serving model.pt as TorchScript" in warnings[0]
    assert runtime.predict(customers(8))[OUTPUT].shape == (8, 1)


def test_inductor_without_an_exported_program_serves_torchscript(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = tiny_model(tmp_path, Difference(), inputs=["a", "b"], outputs=["d"])
    with caplog.at_level(logging.WARNING, "tailserve.runtimes.torch"):
        runtime = loaded(model_dir, compile="inductor")
    assert runtime.compiled == "script"
    assert "model.pt2" in caplog.text and "serving model.pt as TorchScript" in caplog.text


class Difference(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a - b


class TwoWays(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"double": x * 2, "negative": -x}


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, -x


def tiny_model(
    tmp_path: Path,
    module: nn.Module,
    *,
    inputs: list[str],
    outputs: list[str],
    datatype: str = "FP32",
    **extra: Any,
) -> Path:
    import yaml

    model_dir = tmp_path / "m"
    (model_dir / "1").mkdir(parents=True)
    torch.jit.save(torch.jit.script(module), str(model_dir / "1" / "model.pt"))
    config = {
        "name": "m",
        "runtime": "torch",
        "max_batch_size": 8,
        "inputs": [{"name": name, "datatype": datatype, "shape": [2]} for name in inputs],
        "outputs": [{"name": name, "datatype": "FP32", "shape": [2]} for name in outputs],
        **extra,
    }
    (model_dir / "model.yaml").write_text(yaml.safe_dump(config))
    return model_dir


def test_inputs_go_to_forward_by_its_argument_names(tmp_path: Path) -> None:
    # model.yaml lists b before a: forward(a, b) still gets a as a.
    model_dir = tiny_model(tmp_path, Difference(), inputs=["b", "a"], outputs=["d"])
    a = np.array([[5.0, 5.0]], dtype=np.float32)
    b = np.array([[1.0, 2.0]], dtype=np.float32)
    out = loaded(model_dir).predict({"a": a, "b": b})
    np.testing.assert_array_equal(out["d"], a - b)
    with pytest.raises(InvalidInput, match="'a' is missing"):
        loaded(model_dir).predict({"b": b})


def test_a_dict_or_a_tuple_from_the_model_maps_to_model_yamls_outputs(tmp_path: Path) -> None:
    x = np.array([[1.0, -3.0]], dtype=np.float32)
    dict_dir = tiny_model(tmp_path / "d", TwoWays(), inputs=["x"], outputs=["negative", "double"])
    out = loaded(dict_dir).predict({"x": x})
    assert list(out) == ["negative", "double"]
    np.testing.assert_array_equal(out["double"], 2 * x)
    tuple_dir = tiny_model(tmp_path / "t", Pair(), inputs=["x"], outputs=["double", "negative"])
    out = loaded(tuple_dir).predict({"x": x})
    np.testing.assert_array_equal(out["negative"], -x)


def test_a_bad_or_missing_artifact_is_a_load_error(tmp_path: Path) -> None:
    model_dir = tiny_model(tmp_path, Difference(), inputs=["a", "b"], outputs=["d"])
    (model_dir / "1" / "model.pt").write_bytes(b"not a TorchScript archive")
    with pytest.raises(ModelLoadError, match=r"model 'm' version 1: cannot load .*model\.pt"):
        loaded(model_dir)
    (model_dir / "1" / "model.pt").unlink()
    with pytest.raises(ModelLoadError, match=r"model\.pt not found"):
        loaded(model_dir)


def test_bytes_inputs_are_refused_at_load(tmp_path: Path) -> None:
    model_dir = tiny_model(
        tmp_path, Difference(), inputs=["a", "b"], outputs=["d"], datatype="BYTES"
    )
    with pytest.raises(ModelLoadError, match="input 'a' is BYTES, and torch takes no strings"):
        loaded(model_dir)


def test_settings_that_cannot_work_are_refused_naming_the_field(tmp_path: Path) -> None:
    model_dir = tiny_model(tmp_path, Difference(), inputs=["a", "b"], outputs=["d"])
    with pytest.raises(ModelLoadError, match=r"parameters\.compile': 'jit' is not one of"):
        loaded(model_dir, compile="jit")
    with pytest.raises(ModelLoadError, match=r"parameters\.quantize': 'int4'"):
        loaded(model_dir, quantize="int4")
    with pytest.raises(ModelLoadError, match="choose one"):
        loaded(model_dir, quantize="dynamic_int8", compile="inductor")
    with pytest.raises(ModelLoadError, match="forward takes 2 inputs"):
        loaded(tiny_model(tmp_path / "x", Difference(), inputs=["x"], outputs=["d"]))


def test_intra_op_threads_set_torchs_threads(tmp_path: Path) -> None:
    model_dir = tiny_model(
        tmp_path, Difference(), inputs=["a", "b"], outputs=["d"], instances={"intra_op_threads": 1}
    )
    torch.set_num_threads(2)
    loaded(model_dir)
    assert torch.get_num_threads() == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_asked_for_but_absent_serves_on_the_cpu_with_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = tiny_model(
        tmp_path, Difference(), inputs=["a", "b"], outputs=["d"], instances={"providers": ["cuda"]}
    )
    with caplog.at_level(logging.WARNING):
        runtime = loaded(model_dir)
    assert [r.getMessage() for r in caplog.records] == [
        "model 'm' version 1: CUDA asked for but not available; serving on the CPU"
    ]
    a = np.ones((3, 2), dtype=np.float32)
    np.testing.assert_array_equal(runtime.predict({"a": a, "b": a})["d"], np.zeros((3, 2)))
    # A quantised variant is CPU-only, and here it serves on the CPU.
    assert loaded(model_dir, quantize="dynamic_int8").compiled == "script"


def test_the_auc_counts_ties_as_half() -> None:
    labels = np.array([0, 1, 0, 1])
    assert auc(np.array([0.1, 0.9, 0.2, 0.8]), labels) == 1.0
    assert auc(np.array([0.5, 0.5, 0.5, 0.5]), labels) == 0.5
