"""`tailserve optimize` on the example models: the variants it writes load as a worker loads
them and agree with the full model, the report is there, model.yaml's variants parse."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tailserve.cli import main
from tailserve.examples.churn import as_inputs, churn_labels, draw_customers, sample_inputs
from tailserve.modelconfig import load_model_config
from tailserve.runtimes import RuntimeContext, create_runtime

FAST = ["--repeat", "3", "--batch-sizes", "1,16"]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """churn and churn_lgbm (`tailserve examples` without the slower models)."""
    from tailserve.examples.churn import write_churn

    directory = tmp_path_factory.mktemp("examples")
    write_churn(directory)
    return directory


@pytest.fixture
def churn(written: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(written / "churn", tmp_path / "churn"))


def predict(model_dir: Path, variant_name: str | None, inputs: dict[str, np.ndarray]) -> np.ndarray:
    config = load_model_config(model_dir)
    variant = next((v for v in config.variants.choices if v.name == variant_name), None)
    runtime = create_runtime(RuntimeContext(config, 1, model_dir / "1", variant=variant))
    runtime.load()
    try:
        return np.asarray(runtime.predict(inputs)["churn_probability"])
    finally:
        runtime.unload()


def test_optimize_writes_variants_that_serve_and_a_report(
    churn: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keep = "fp32,int8-dynamic,int8-static"
    assert main(["optimize", str(churn), *FAST, "--keep", keep]) == 0
    out = capsys.readouterr().out
    assert "int8-dynamic" in out
    assert f"report: {churn / 'optimize' / 'report.md'}" in out

    for name in ("model.opt.onnx", "model.int8-dynamic.onnx", "model.int8-static.onnx"):
        assert (churn / "1" / name).stat().st_size > 0
    report = json.loads((churn / "optimize" / "report.json").read_text())
    assert report["metric"] == "auc"  # one probability a row
    assert report["held_out"]["labels"] is False
    by_name = {v["name"]: v for v in report["variants"]}
    assert set(by_name) == {"fp32", "fp32-opt", "int8-dynamic", "int8-static"}
    for variant in by_name.values():
        assert set(variant["latency_ms"]) == {"1", "16"}
        assert all(ms > 0 for ms in variant["latency_ms"].values())
    assert by_name["fp32"]["accuracy"] == 1.0
    assert by_name["int8-dynamic"]["accuracy"] > 0.99
    markdown = (churn / "optimize" / "report.md").read_text()
    assert "| int8-dynamic |" in markdown
    assert (churn / "optimize" / "latency.png").stat().st_size > 0
    assert "![latency" in markdown

    # model.yaml: the kept variants, most accurate first, each with its figures.
    config = load_model_config(churn)
    choices = config.variants.choices
    assert sorted(v.name for v in choices) == sorted(keep.split(","))
    accuracies = [v.accuracy for v in choices]
    assert accuracies == sorted(accuracies, reverse=True)  # type: ignore[type-var]
    assert all(set(v.latency_ms) == {1, 16} and v.size_bytes for v in choices)
    assert config.cache.enabled  # the rest of model.yaml is as it was
    assert (churn / "model.yaml").read_text().startswith("# Written by `tailserve examples`")

    # The quantised model loads as a worker loads it, and answers close to the full model.
    inputs = sample_inputs(256, seed=5)
    full = predict(churn, None, inputs)
    quantised = predict(churn, "int8-dynamic", inputs)
    assert quantised.shape == full.shape == (256, 1)
    assert float(np.abs(quantised - full).max()) < 0.05


def test_held_out_labels_and_no_config_write(churn: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(21)
    customers = draw_customers(rng, 600)
    labels = churn_labels(customers, rng)
    arrays = {
        name: (array.astype(str) if array.dtype.kind == "O" else array)
        for name, array in as_inputs(customers).items()
    }
    held_out = tmp_path / "held.npz"
    np.savez(held_out, labels=labels, **arrays)
    before = (churn / "model.yaml").read_text()
    argv = ["optimize", str(churn), *FAST, "--held-out", str(held_out), "--no-write-config"]
    assert main([*argv, "--variants", "dynamic", "--metric", "accuracy"]) == 0
    assert (churn / "model.yaml").read_text() == before
    assert not (churn / "1" / "model.int8-static.onnx").exists()
    report = json.loads((churn / "optimize" / "report.json").read_text())
    assert report["metric"] == "accuracy"
    assert report["held_out"] == {"source": str(held_out), "rows": 600, "labels": True}
    by_name = {v["name"]: v for v in report["variants"]}
    assert set(by_name) == {"fp32", "int8-dynamic"}
    # Against labels: the model's own accuracy, well above chance, not 1.
    assert 0.6 < by_name["fp32"]["accuracy"] < 1.0
    assert abs(by_name["int8-dynamic"]["accuracy"] - by_name["fp32"]["accuracy"]) < 0.05


def test_a_variant_model_yaml_already_had_is_measured_and_kept(churn: Path) -> None:
    shutil.copy(churn / "1" / "model.onnx", churn / "1" / "model.small.onnx")
    text = (churn / "model.yaml").read_text()
    text += "variants:\n  choices:\n  - {name: small, artifact: model.small.onnx}\n"
    (churn / "model.yaml").write_text(text)
    assert main(["optimize", str(churn), *FAST, "--variants", "graph"]) == 0
    choices = {v.name: v for v in load_model_config(churn).variants.choices}
    assert "small" in choices
    assert choices["small"].accuracy == 1.0  # the same graph as the full model
    assert set(choices["small"].latency_ms) == {1, 16}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--version", "7"], "no version 7"),
        (["--held-out", "{tmp}/absent.npz"], "cannot read it as .npz"),
        (["--calibration", "{tmp}/junk.npz"], "cannot read it as .npz"),
        (["--batch-sizes", "1,1000"], "within 1..256"),
        (["--variants", "turbo"], "unknown kind 'turbo'"),
    ],
)
def test_errors_are_one_line_and_exit_2(
    churn: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    (tmp_path / "junk.npz").write_bytes(b"not a zip file")
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    assert main(["optimize", str(churn), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_model_it_cannot_optimise_is_refused(
    written: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["optimize", str(tmp_path)]) == 2
    assert "model.yaml: not found" in capsys.readouterr().err
    assert main(["optimize", str(written / "churn_lgbm")]) == 2
    assert "runtime 'lightgbm'" in capsys.readouterr().err


def test_the_sequence_model_gets_a_quarter_size_int8_variant(tmp_path: Path) -> None:
    from tailserve.examples.sentiment import write_sentiment

    model_dir = tmp_path / write_sentiment(
        tmp_path, measure=False
    )  # (its model.yaml names it int8)
    argv = ["optimize", str(model_dir), "--repeat", "2", "--batch-sizes", "1,8"]
    assert main([*argv, "--variants", "dynamic", "--keep", "fp32,int8"]) == 0
    report = json.loads((model_dir / "optimize" / "report.json").read_text())
    # Padded batches of several lengths were scored; one length was timed.
    assert "token_ids 64 long" in report["timing"]
    by_name = {v["name"]: v for v in report["variants"]}
    assert by_name["int8"]["accuracy"] > 0.99
    # INT8 weights: a quarter of the FP32 bytes (embedding and both per-token layers).
    assert by_name["int8"]["size_bytes"] < 0.3 * by_name["fp32"]["size_bytes"]
    assert [v.name for v in load_model_config(model_dir).variants.choices] == [
        "fp32",
        "int8",
    ]
