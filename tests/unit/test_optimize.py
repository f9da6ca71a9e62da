"""tailserve optimize's pure parts: the metrics, which variants are kept and in what order, the
inputs it reads, and the rewrite of model.yaml."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tailserve.errors import ConfigError
from tailserve.modelconfig import Variant, load_model_config, parse_model_config
from tailserve.optimize.accuracy import accuracy, auc, default_metric, max_abs_error, measure
from tailserve.optimize.candidates import (
    TORCH_INT8,
    Candidate,
    Skipped,
    adopt_names,
    existing_candidates,
    torch_candidates,
)
from tailserve.optimize.choose import Result, choose, speedups
from tailserve.optimize.datasets import load_npz
from tailserve.optimize.measure import time_batches
from tailserve.optimize.modelyaml import header, rewrite, variants_block

# --- metrics ---------------------------------------------------------------------------------


def test_auc_matches_a_hand_count_with_ties() -> None:
    # Positives 0.35, 0.8, 0.4 against negatives 0.1, 0.4: of the six pairs the positive
    # outranks the negative in four, and 0.4 against 0.4 is a tie worth a half: 4.5 / 6.
    scores = np.array([0.1, 0.4, 0.35, 0.8, 0.4])
    labels = np.array([0, 0, 1, 1, 1])
    assert auc(scores, labels) == pytest.approx(0.75)


def test_auc_edges() -> None:
    labels = np.array([0, 0, 1, 1])
    assert auc(np.array([0.1, 0.2, 0.8, 0.9]), labels) == 1.0
    assert auc(np.array([0.9, 0.8, 0.2, 0.1]), labels) == 0.0
    assert auc(np.full(4, 0.3), labels) == 0.5  # all tied: a coin toss
    assert math.isnan(auc(np.array([0.1, 0.9]), np.array([1, 1])))  # one class: undefined


def test_auc_agrees_with_the_pairwise_definition_on_random_scores() -> None:
    rng = np.random.default_rng(3)
    scores = np.round(rng.random(300), 2)  # rounded: many ties
    labels = rng.integers(0, 2, 300)
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert auc(scores, labels) == pytest.approx(pairs / (len(pos) * len(neg)))


def test_accuracy_and_largest_error() -> None:
    assert accuracy(np.array([0.2, 0.5, 0.7, 0.4]), np.array([0, 1, 0, 0])) == 0.75
    reference = {"p": np.array([0.1, 0.5]), "q": np.array([1.0])}
    assert max_abs_error({"p": np.array([0.1, 0.75]), "q": np.array([0.9])}, reference) == 0.25
    assert max_abs_error({"p": np.array([0.1]), "q": np.array([1.0])}, reference) == math.inf


def test_without_labels_the_full_models_decisions_are_the_truth() -> None:
    reference = {"p": np.array([0.2, 0.6, 0.9, 0.4])}
    # Decisions of the full model: 0, 1, 1, 0. The variant ranks them perfectly...
    variant = {"p": np.array([0.3, 0.45, 0.7, 0.35])}
    assert measure("auc", variant, reference, "p", None) == 1.0
    # ...but one of its decisions (0.45) flips.
    assert measure("accuracy", variant, reference, "p", None) == 0.75
    # With labels, the labels are the truth.
    assert measure("accuracy", variant, reference, "p", np.array([0, 0, 1, 0])) == 1.0


@pytest.mark.parametrize(
    ("scores", "labels", "expected"),
    [
        ([0.1, 0.7, 0.4], None, "auc"),  # probabilities, both decisions present
        ([0.1, 0.2, 0.4], None, "max_abs_error"),  # one decision only: AUC undefined
        ([0.1, 0.2, 0.4], [0, 1, 0], "auc"),  # ... unless labels hold both classes
        ([0.1, 1.7, 0.4], None, "max_abs_error"),  # not a probability
        ([-3.0, 2.0, 0.5], None, "max_abs_error"),
    ],
)
def test_default_metric(scores: list[float], labels: list[int] | None, expected: str) -> None:
    truth = None if labels is None else np.array(labels)
    assert default_metric(np.array(scores), truth) == expected


# --- which variants are kept, in what order ---------------------------------------------------


def result(name: str, accuracy: float, ms: dict[int, float], *, made: bool = True) -> Result:
    artifact = None if name == "fp32" else f"model.{name}.onnx"
    return Result(Variant(name, artifact, accuracy=accuracy, latency_ms=ms), made=made)


def names(results: list[Result], *, kept: bool | None = None) -> list[str]:
    return [r.name for r in results if kept is None or r.kept == kept]


def test_the_most_accurate_first_and_ties_go_to_the_faster() -> None:
    results = [
        result("fp32", 1.0, {1: 1.0, 64: 10.0}),
        result("int8-static", 0.97, {1: 0.4, 64: 3.0}),
        result("int8-dynamic", 0.99, {1: 0.5, 64: 4.0}),
        # As accurate as fp32 to six decimals: a tie, and it is faster.
        result("fp32-opt", 0.9999999, {1: 0.9, 64: 9.0}),
    ]
    ordered = choose(results, "auc", keep=None)
    assert names(ordered) == ["fp32-opt", "fp32", "int8-dynamic", "int8-static"]


def test_for_the_largest_error_smaller_comes_first() -> None:
    results = [
        result("fp32", 0.0, {1: 1.0}),
        result("int8-static", 0.2, {1: 0.4}),
        result("int8-dynamic", 0.01, {1: 0.5}),
    ]
    assert names(choose(results, "max_abs_error", keep=None)) == [
        "fp32",
        "int8-dynamic",
        "int8-static",
    ]


def test_kept_by_default_fp32_and_what_is_faster_somewhere() -> None:
    results = [
        result("fp32", 1.0, {1: 1.0, 64: 10.0}),
        # 1.25 times as fast at 64 rows, slower at 1: kept.
        result("int8-dynamic", 0.99, {1: 1.2, 64: 8.0}),
        # 1.05 times as fast at best: not worth a place.
        result("int8-static", 0.98, {1: 0.96, 64: 9.5}),
        # Not faster, but model.yaml had it: kept, with its new figures.
        result("small", 0.9, {1: 1.5, 64: 12.0}, made=False),
    ]
    ordered = choose(results, "auc", keep=None)
    assert names(ordered, kept=True) == ["fp32", "int8-dynamic", "small"]
    assert names(ordered, kept=False) == ["int8-static"]
    assert speedups(ordered[1], ordered[0]) == pytest.approx({1: 1 / 1.2, 64: 1.25})


def test_the_graph_optimised_model_takes_fp32s_place_only_when_as_accurate() -> None:
    fp32 = result("fp32", 1.0, {1: 1.0, 64: 10.0})
    same = result("fp32-opt", 1.0, {1: 0.8, 64: 10.0})
    assert names(choose([fp32, same], "auc", keep=None), kept=True) == ["fp32-opt"]
    worse = result("fp32-opt", 0.99, {1: 0.8, 64: 10.0})
    assert names(choose([fp32, worse], "auc", keep=None), kept=True) == ["fp32", "fp32-opt"]
    slow = result("fp32-opt", 1.0, {1: 0.98, 64: 10.0})
    assert names(choose([fp32, slow], "auc", keep=None), kept=True) == ["fp32"]


def test_an_explicit_keep_list_replaces_the_rule() -> None:
    results = [result("fp32", 1.0, {1: 1.0}), result("int8-static", 0.9, {1: 0.99})]
    ordered = choose(results, "auc", keep=["int8-static"])
    assert names(ordered, kept=True) == ["int8-static"]
    with pytest.raises(ConfigError, match="no variant 'int8'"):
        choose(results, "auc", keep=["int8"])


def test_a_torch_model_gets_its_int8_form_as_a_setting() -> None:
    found = torch_candidates(["graph", "dynamic", "static"])
    made = [item for item in found if isinstance(item, Candidate)]
    assert [item.variant for item in made] == [TORCH_INT8]
    assert TORCH_INT8.artifact is None
    assert TORCH_INT8.parameters == {"quantize": "dynamic_int8"}
    assert sorted(item.name for item in found if isinstance(item, Skipped)) == ["graph", "static"]


def test_a_remade_variant_keeps_the_name_model_yaml_gave_it() -> None:
    config = parse_model_config(
        {
            **CONFIG,
            "variants": {
                "choices": [
                    {"name": "full"},  # the model itself by another name: fp32 now
                    {"name": "int8", "artifact": "model.int8-dynamic.onnx", "accuracy": 0.9},
                    {"name": "small", "artifact": "model.small.onnx"},
                ]
            },
        },
        source="test",
    )
    made = [Candidate(Variant("int8-dynamic", "model.int8-dynamic.onnx"), made=True)]
    (adopted,) = adopt_names(made, config.variants.choices)
    assert adopted.variant == Variant("int8", "model.int8-dynamic.onnx")
    existing = existing_candidates(config, {"int8"})
    assert [c.variant for c in existing] == [Variant("small", "model.small.onnx")]
    assert not existing[0].made


# --- timing ----------------------------------------------------------------------------------


class Ticking:
    """A runtime that takes a fixed time a call on a fake clock, its first call slower."""

    steady = True

    def __init__(self, clock: list[float], seconds: float) -> None:
        self.clock, self.seconds, self.calls = clock, seconds, 0

    def predict(self, inputs: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        self.clock[0] += self.seconds * (50 if self.calls == 1 else 1)
        return {}

    def load(self) -> None: ...
    def describe(self) -> Any: ...
    def unload(self) -> None: ...


def test_latency_is_the_median_of_warm_runs() -> None:
    now = [0.0]
    runtimes = {"fast": Ticking(now, 0.001), "slow": Ticking(now, 0.004)}
    batches = {1: {"x": np.zeros((1, 1))}, 8: {"x": np.zeros((8, 1))}}
    latency = time_batches(runtimes, batches, repeat=5, clock=lambda: now[0])
    assert latency == {
        "fast": pytest.approx({1: 1.0, 8: 1.0}),
        "slow": pytest.approx({1: 4.0, 8: 4.0}),
    }


# --- inputs from a file ----------------------------------------------------------------------

CONFIG: dict[str, Any] = {
    "name": "m",
    "runtime": "onnx",
    "max_batch_size": 4,
    "inputs": [
        {"name": "x", "datatype": "FP32", "shape": [2]},
        {"name": "kind", "datatype": "BYTES", "shape": [1]},
    ],
    "outputs": [{"name": "p", "datatype": "FP32", "shape": [1]}],
    "warmup": {"batch_sizes": [1, 4]},
}


def test_an_npz_file_is_cut_into_batches_with_its_labels(tmp_path: Path) -> None:
    config = parse_model_config(CONFIG, source="test")
    path = tmp_path / "held.npz"
    kinds = np.array(["a", "b", "a", "b", "a", "b"])
    np.savez(path, x=np.ones((6, 2)), kind=kinds, labels=np.array([0, 1, 0, 1, 1, 1]))
    dataset = load_npz(path, config, chunk=4, what="--held-out")
    assert dataset.rows == 6
    assert [batch["x"].shape for batch in dataset.batches] == [(4, 2), (2, 2)]
    assert dataset.batches[0]["x"].dtype == np.float32
    assert dataset.batches[1]["kind"].tolist() == [["a"], ["b"]]
    assert dataset.labels is not None
    assert dataset.labels.tolist() == [0, 1, 0, 1, 1, 1]


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"x": np.ones((3, 2))}, "no array for input 'kind'"),
        ({"x": np.ones((3, 3)), "kind": np.array(["a"] * 3)}, "has shape"),
        ({"x": np.ones((3, 2)), "kind": np.array(["a"] * 2)}, "different numbers of rows"),
        ({"x": np.ones((3, 2)), "kind": np.array(["a"] * 3), "y": np.ones(3)}, "'y' is not an"),
        (
            {"x": np.ones((3, 2)), "kind": np.array(["a"] * 3), "labels": np.array([0, 2, 1])},
            "0 or 1",
        ),
        ({"x": np.ones((3, 2)), "kind": np.array(["a"] * 3, dtype=object)}, "cannot read it"),
    ],
)
def test_an_npz_file_that_does_not_fit_is_one_clear_error(
    tmp_path: Path, arrays: dict[str, Any], message: str
) -> None:
    config = parse_model_config(CONFIG, source="test")
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)  # an object array is pickled: it must not be read back
    with pytest.raises(ConfigError, match=message):
        load_npz(path, config, chunk=4, what="--held-out")


# --- model.yaml ------------------------------------------------------------------------------

MODEL_YAML = """\
# Written by hand.
# Two lines of header.
runtime: onnx
max_batch_size: 4
inputs:
- {name: x, datatype: FP32, shape: [2]}
outputs:
- {name: p, datatype: FP32, shape: [1]}
warmup: {batch_sizes: [1, 4], repeat: 2}
variants:
  metric: auc
  floor: 0.95
  choices:
  - {name: old, artifact: model.old.onnx, accuracy: 0.99}
slo: {p99_ms: 20}
"""


def measured(name: str, accuracy: float, artifact: str | None = None) -> Variant:
    return Variant(name, artifact, accuracy=accuracy, latency_ms={1: 0.5, 4: 1.25}, size_bytes=9)


def test_the_rewrite_sets_variants_and_keeps_the_rest(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "model.yaml").write_text(MODEL_YAML)
    before = yaml.safe_load(MODEL_YAML)
    choices = [measured("fp32", 1.0), measured("int8-dynamic", 0.98, "model.int8-dynamic.onnx")]
    rewrite(model_dir, variants_block("auc", 0.95, choices))

    text = (model_dir / "model.yaml").read_text()
    assert text.startswith("# Written by hand.\n# Two lines of header.\nruntime: onnx\n")
    after = yaml.safe_load(text)
    assert list(after) == list(before)  # the same keys, in the same order
    assert {k: v for k, v in after.items() if k != "variants"} == {
        k: v for k, v in before.items() if k != "variants"
    }
    config = load_model_config(model_dir)
    assert config.variants.floor == 0.95
    assert [v.name for v in config.variants.choices] == ["fp32", "int8-dynamic"]
    assert config.variants.choices[1] == choices[1]
    assert after["variants"]["choices"][0] == {
        "name": "fp32",
        "accuracy": 1.0,
        "latency_ms": {1: 0.5, 4: 1.25},
        "size_bytes": 9,
    }


def test_a_rewrite_the_worker_would_refuse_is_not_written(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "model.yaml").write_text(MODEL_YAML)
    # Every variant below the floor: none could serve.
    block = variants_block("auc", 0.95, [measured("fp32", 0.9)])
    with pytest.raises(ConfigError, match="floor"):
        rewrite(model_dir, block)
    assert (model_dir / "model.yaml").read_text() == MODEL_YAML
    assert sorted(p.name for p in model_dir.iterdir()) == ["model.yaml"]


def test_header_is_the_leading_comments() -> None:
    assert header("# a\n\n# b\nname: x\n# not this\n") == "# a\n\n# b\n"
    assert header("name: x\n") == ""


def test_without_matplotlib_the_report_says_the_plot_was_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tailserve.optimize.plot import latency_plot
    from tailserve.optimize.report import Outcome, as_markdown

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    results = choose([result("fp32", 1.0, {1: 1.0}), result("int8", 0.9, {1: 0.5})], "auc", None)
    reason = latency_plot(results, tmp_path / "latency.png", "t")
    assert reason is not None and "matplotlib is not installed" in reason
    assert not (tmp_path / "latency.png").exists()
    outcome = Outcome(
        model="m",
        version=1,
        runtime="onnx",
        metric="auc",
        metric_note="against labels",
        held_out="held.npz",
        held_out_rows=10,
        labels=True,
        calibration=None,
        batch_sizes=[1],
        repeat=3,
        timing_note="median",
        results=results,
        skipped=[Skipped("int8-static", "no operator could be quantised")],
        config="left as it was",
        plot=None,
        plot_note=reason,
    )
    markdown = as_markdown(outcome)
    assert "*The plot was skipped: matplotlib is not installed" in markdown
    assert "| int8 | yes | model.int8.onnx |" in markdown
    assert "0.500 (2.00x)" in markdown  # latency at 1 row, with its speed-up over fp32
    assert "- **int8-static**: no operator could be quantised" in markdown
