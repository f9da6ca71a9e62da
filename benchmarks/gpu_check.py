"""The GPU paths on a machine with CUDA: the torch runtime, torch.compile, ONNX Runtime's CUDA.

Writes the churn_torch example (trained on the CPU) to a temporary folder, then runs each part
in a child process with its own time limit (a hung CUDA call ends that part, not the check):

- ``cpu``: TorchRuntime on the CPU, fp32 (TorchScript) and int8;
- ``cuda``: TorchRuntime on CUDA, plain copies and through pinned buffers on a copy stream,
  with and without TorchScript's profiling executor;
- ``inductor``: ``compile: inductor`` on CUDA (reduce-overhead: CUDA graphs on padded batch
  sizes), its load (compile) time and its first calls after load;
- ``ort``: ONNX Runtime on the same MLP: CUDA with I/O binding vs ``session.run`` on the CPU.

Each timing is the median of 50 predicts after warm-up, at batch 1, 8, 64 and 256; outputs are
compared with the CPU's fp32 on the same inputs. It prints a table and writes
``$OUT/gpu_check.json`` where OUT is set. With no CUDA it runs the CPU parts and says so. The
whole check keeps within ``--budget`` seconds (170).

    PYTHONPATH=src python benchmarks/gpu_check.py [--budget 170] [--repeats 50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

BATCHES = (1, 8, 64, 256)
# A part's own limit (seconds), cut to what is left of the budget.
PARTS = {"cpu": 40.0, "cuda": 50.0, "inductor": 110.0, "ort": 40.0, "raw": 60.0}


# --- the parent ---------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=170.0, help="seconds in all (170)")
    parser.add_argument("--repeats", type=int, default=50, help="timed predicts a batch size")
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:
        return child(args.part, Path(args.work), args.repeats)
    started = time.monotonic()
    report: dict[str, Any] = {"machine": machine()}
    print_machine(report["machine"])
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        work_dir = Path(work)
        t0 = time.perf_counter()
        from tailserve.examples.churn_torch import write_churn_torch

        write_churn_torch(work_dir)
        report["train_s"] = round(time.perf_counter() - t0, 1)
        print(f"churn_torch written in {report['train_s']} s")
        cuda = report["machine"].get("cuda", False)
        for part, limit in PARTS.items():
            if part in ("cuda", "inductor", "raw") and not cuda:
                print(f"[{part}] skipped: torch sees no CUDA device")
                report[part] = {"skipped": "no CUDA"}
                continue
            left = args.budget - (time.monotonic() - started)
            if left < 10:
                print(f"[{part}] skipped: the budget is spent")
                report[part] = {"skipped": "budget"}
                continue
            report[part] = run_part(part, work_dir, min(limit, left - 5), args.repeats)
        compare(report, work_dir)
    report["total_s"] = round(time.monotonic() - started, 1)
    print_table(report)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {Path(out) / 'gpu_check.json'}")
    return 0


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.is_available()
        if info["cuda"]:
            info["device"] = torch.cuda.get_device_name(0)
            info["cuda_version"] = torch.version.cuda
    except Exception as exc:  # a broken install is a finding, not a crash
        info["torch_error"] = repr(exc)
    try:
        import onnxruntime as ort

        info["onnxruntime"] = ort.__version__
        info["ort_providers"] = ort.get_available_providers()
    except Exception as exc:
        info["onnxruntime_error"] = repr(exc)
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        info["nvidia_smi"] = listing.stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        info["nvidia_smi"] = f"({type(exc).__name__})"
    from tailserve.fleet.gpus import describe, detect_gpus, parse_gpus

    devices = parse_gpus("auto", os.environ)
    devices = detect_gpus() if devices is None else devices
    info["tailserve_up_gpus"] = describe(devices, max(len(devices), 1))
    return info


def print_machine(info: dict[str, Any]) -> None:
    for key, value in info.items():
        print(f"{key}: {value}")


def run_part(part: str, work: Path, limit: float, repeats: int) -> dict[str, Any]:
    result_file = work / f"{part}.json"
    command = [sys.executable, __file__, "--part", part, "--work", str(work)]
    command += ["--repeats", str(repeats)]
    print(f"[{part}] running (limit {limit:.0f} s)", flush=True)
    t0 = time.perf_counter()
    try:
        done = subprocess.run(command, timeout=limit, capture_output=True, text=True)
    except subprocess.TimeoutExpired as exc:
        print(f"[{part}] TIMED OUT after {limit:.0f} s")
        kept: dict[str, Any] = {"rows": []}
        if result_file.exists():
            kept = json.loads(result_file.read_text())
        kept["notes"] = [*kept.get("notes", []), f"timed out after {limit:.0f} s"]
        kept["stderr"] = str(exc.stderr or "")[-1500:]
        return kept
    took = round(time.perf_counter() - t0, 1)
    for line in done.stdout.splitlines():
        print(f"[{part}] {line}")
    if done.returncode != 0 or not result_file.exists():
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        print(f"[{part}] FAILED (exit {done.returncode}):\n{tail}")
        kept: dict[str, Any] = {"error": f"exit {done.returncode}", "stderr": tail, "wall_s": took}
        if result_file.exists():  # what it finished before it failed
            kept.update(json.loads(result_file.read_text()))
        return kept
    result: dict[str, Any] = json.loads(result_file.read_text())
    result["wall_s"] = took
    return result


def compare(report: dict[str, Any], work: Path) -> None:
    """Each configuration's outputs against the CPU's fp32, on the same inputs."""
    reference_file = work / "out-cpu-fp32.npy"
    if not reference_file.exists():
        return
    reference = np.load(reference_file)
    for part in PARTS:
        for row in report.get(part, {}).get("rows", []):
            path = work / f"out-{part}-{row['name']}.npy"
            if path.exists():
                row["max_abs_diff_vs_cpu_fp32"] = float(np.abs(np.load(path) - reference).max())


def print_table(report: dict[str, Any]) -> None:
    head = f"{'part':9} {'config':24} {'device':7} {'load s':>7}"
    head += "".join(f" {'b' + str(b) + ' ms':>9}" for b in BATCHES) + f" {'max|diff|':>10}"
    print("\n" + head + "\n" + "-" * len(head))
    for part in PARTS:
        section = report.get(part, {})
        if "rows" not in section and "notes" not in section:
            reason = section.get("skipped") or section.get("error") or "no result"
            print(f"{part:9} ({reason})")
            continue
        for row in section.get("rows", []):
            if "error" in row:
                print(f"{part:9} {row['name']:24} {row.get('device', ''):7} error: {row['error']}")
                continue
            cells = "".join(f" {row['median_ms'].get(str(b), float('nan')):9.3f}" for b in BATCHES)
            diff = row.get("max_abs_diff_vs_cpu_fp32")
            shown = f"{diff:10.2e}" if diff is not None else f"{'':>10}"
            print(
                f"{part:9} {row['name']:24} {row['device']:7} {row['load_s']:7.2f}{cells} {shown}"
            )
        for note in section.get("notes", []):
            print(f"{part:9} note: {note}")
        if "error" in section:
            print(f"{part:9} error: {section['error']}")
    print(f"\ntotal {report.get('total_s')} s")


# --- the children -------------------------------------------------------------------------


def child(part: str, work: Path, repeats: int) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    model_dir = work / "churn_torch"
    result = work / f"{part}.json"

    def flush() -> None:
        # Written after each step: a part cut off by its time limit keeps what it finished.
        result.write_text(json.dumps({"rows": rows, "notes": notes}, default=str))

    def add(row: dict[str, Any]) -> None:
        rows.append(row)
        for key in ("compiled", "first_ms", "other_thread_ms"):
            if key in row and row.get("device") == "cuda":
                notes.append(f"{row['name']}: {key} {row[key]}")
        flush()

    configs: dict[str, list[tuple[str, dict[str, Any], list[str]]]] = {
        "cpu": [("fp32", {}, ["cpu"]), ("int8", {"quantize": "dynamic_int8"}, ["cpu"])],
        "cuda": [
            ("fp32-plain", {}, ["cuda"]),
            ("fp32-pinned", {"pinned": True}, ["cuda"]),
            ("fp32-unfrozen", {"compile": "none"}, ["cuda"]),
            ("fp32-jit-profiling", {"jit_profiling": True}, ["cuda"]),
        ],
        "inductor": [
            ("inductor-reduce-overhead", {"compile": "inductor"}, ["cuda"]),
            ("inductor-default", {"compile": "inductor", "compile_mode": "default"}, ["cuda"]),
        ],
    }
    for name, parameters, providers in configs.get(part, []):
        add(torch_row(model_dir, work, part, name, parameters, providers, repeats))
    if part == "cuda":
        add(int8_on_cuda(model_dir))
    if part == "ort":
        for row in ort_rows(model_dir, work, repeats, notes):
            add(row)
    if part == "raw":
        raw_notes(model_dir, repeats, notes, flush)
    flush()
    return 0


def sample(config: Any, rows: int, seed: int) -> dict[str, np.ndarray[Any, Any]]:
    from tailserve.examples.churn import sample_inputs

    full = sample_inputs(rows, seed=seed)
    return {spec.name: full[spec.name] for spec in config.inputs}


def context(model_dir: Path, parameters: dict[str, Any], providers: list[str]) -> Any:
    import msgspec

    from tailserve.modelconfig import load_model_config, parse_model_config
    from tailserve.runtimes import RuntimeContext

    raw = msgspec.to_builtins(load_model_config(model_dir))
    raw["parameters"] = parameters
    raw["instances"] = {**raw["instances"], "providers": providers, "intra_op_threads": 1}
    raw.pop("variants", None)
    config = parse_model_config(raw, source="gpu_check")
    return RuntimeContext(config, 1, model_dir / "1")


def timings(runtime: Any, config: Any, repeats: int) -> dict[str, float]:
    medians = {}
    for size in BATCHES:
        batch = sample(config, size, seed=size)
        for _ in range(5):
            runtime.predict(batch)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runtime.predict(batch)
            times.append(time.perf_counter() - t0)
        medians[str(size)] = round(statistics.median(times) * 1e3, 4)
    return medians


def torch_row(
    model_dir: Path,
    work: Path,
    part: str,
    name: str,
    parameters: dict[str, Any],
    providers: list[str],
    repeats: int,
) -> dict[str, Any]:
    from tailserve.runtimes import create_runtime

    row: dict[str, Any] = {"name": name, "device": providers[0], "parameters": parameters}
    try:
        ctx = context(model_dir, parameters, providers)
        runtime = create_runtime(ctx)
        t0 = time.perf_counter()
        runtime.load()
        row["load_s"] = round(time.perf_counter() - t0, 2)
        row["compiled"] = getattr(runtime, "compiled", None)
        first = {}
        for size in BATCHES:  # the first call at each size, right after load
            batch = sample(ctx.config, size, seed=100 + size)
            t0 = time.perf_counter()
            runtime.predict(batch)
            first[str(size)] = round((time.perf_counter() - t0) * 1e3, 3)
        row["first_ms"] = first
        row["other_thread_ms"] = other_thread(runtime, sample(ctx.config, 64, seed=7))
        row["median_ms"] = timings(runtime, ctx.config, repeats)
        out = runtime.predict(sample(ctx.config, 256, seed=1))["churn_probability"]
        np.save(work / f"out-{part}-{name}.npy", out)
        runtime.unload()
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    print(json.dumps({k: v for k, v in row.items() if k != "parameters"}), flush=True)
    return row


def other_thread(runtime: Any, batch: dict[str, Any]) -> list[float]:
    """The first two calls from a thread that has not called before (an instance's thread)."""
    times: list[float] = []

    def run() -> None:
        for _ in range(2):
            t0 = time.perf_counter()
            runtime.predict(batch)
            times.append(round((time.perf_counter() - t0) * 1e3, 3))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return times


def raw_notes(model_dir: Path, repeats: int, notes: list[str], save: Any) -> None:
    """The modules alone on 64 rows already on the GPU, synchronised after each call: what
    the runtime's copies and calls add, and what each form of the module costs."""
    import torch
    from torch.export.passes import move_to_device_pass

    from tailserve.examples.churn import training_data
    from tailserve.examples.churn_torch import as_tensors

    device = torch.device("cuda")
    with torch.inference_mode():  # as the runtime makes them
        inputs = [x.to(device) for x in as_tensors(training_data(rows=64)[0])]

    def median_ms(call: Any, graphs: bool = False) -> float:
        times = []
        with torch.inference_mode():
            for i in range(5 + repeats):
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                t0 = time.perf_counter()
                call(*inputs)
                torch.cuda.synchronize()
                if i >= 5:
                    times.append(time.perf_counter() - t0)
        return round(statistics.median(times) * 1e3, 4)

    program = move_to_device_pass(torch.export.load(str(model_dir / "1" / "model.pt2")), device)
    forms: list[tuple[str, Any, bool]] = [("exported, eager", program.module(), False)]
    script = torch.jit.load(str(model_dir / "1" / "model.pt"), map_location=device).eval()
    frozen = torch.jit.optimize_for_inference(torch.jit.freeze(script))
    forms.append(("torchscript frozen", frozen, False))
    for name, module, graphs in forms:
        with torch.jit.optimized_execution(False):
            notes.append(f"raw b64 {name}: {median_ms(module, graphs)} ms")
        save()
    for name, dynamic in (("inductor reduce-overhead dynamic", True), ("static", False)):
        t0 = time.perf_counter()
        try:
            compiled = torch.compile(program.module(), dynamic=dynamic, mode="reduce-overhead")
            notes.append(f"raw b64 {name}: {median_ms(compiled, True)} ms")
            notes[-1] += f" (compile and runs {time.perf_counter() - t0:.1f} s)"
        except Exception as exc:  # the runtime's own compile is measured in "inductor"
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            notes.append(f"raw b64 {name}: failed: {type(exc).__name__}: {first}")
        save()


def int8_on_cuda(model_dir: Path) -> dict[str, Any]:
    """A quantised variant on CUDA must be refused at load, in words."""
    from tailserve.errors import ModelLoadError
    from tailserve.runtimes import create_runtime

    row: dict[str, Any] = {"name": "int8-refused", "device": "cuda"}
    try:
        create_runtime(context(model_dir, {"quantize": "dynamic_int8"}, ["cuda"])).load()
        row["error"] = "loaded, but it should have been refused"
    except ModelLoadError as exc:
        row["error"] = f"refused as it should be: {str(exc)[:120]}"
    return row


def ort_rows(model_dir: Path, work: Path, repeats: int, notes: list[str]) -> list[dict[str, Any]]:
    """The churn_torch MLP as an ONNX graph (built from its weights), served by OnnxRuntime."""
    try:
        import onnx  # noqa: F401
        import onnxruntime as ort
    except ImportError as exc:
        notes.append(f"ORT part skipped: {exc.name} is not installed")
        print(notes[-1])
        return []
    providers = ort.get_available_providers()
    if "CUDAExecutionProvider" not in providers:
        notes.append(
            f"ONNX Runtime has no CUDAExecutionProvider here (it has {providers}): the I/O "
            "binding path runs on the CPU only"
        )
        print(notes[-1])
    onnx_dir = work / "churn_onnx_mlp"
    write_onnx_mlp(model_dir, onnx_dir)
    rows = []
    runs = [
        ("run-cpu", ["cpu"], {"io_binding": False}),
        ("bound-cpu", ["cpu"], {"io_binding": True}),
    ]
    if "CUDAExecutionProvider" in providers:
        runs += [("bound-cuda", ["cuda"], {}), ("run-cuda", ["cuda"], {"io_binding": False})]
    from tailserve.runtimes import create_runtime

    for name, device, parameters in runs:
        row: dict[str, Any] = {"name": name, "device": device[0]}
        try:
            ctx = context(onnx_dir, parameters, device)
            runtime = create_runtime(ctx)
            t0 = time.perf_counter()
            runtime.load()
            row["load_s"] = round(time.perf_counter() - t0, 2)
            row["median_ms"] = timings(runtime, ctx.config, repeats)
            out = runtime.predict(sample(ctx.config, 256, seed=1))["churn_probability"]
            np.save(work / f"out-ort-{name}.npy", out)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def write_onnx_mlp(model_dir: Path, onnx_dir: Path) -> None:
    """The same model in ONNX: casts, log1p of the spend, standardise, three Gemms."""
    import onnx
    import torch
    from onnx import TensorProto, helper, numpy_helper

    from tailserve.examples.churn_torch import INPUTS

    module = torch.jit.load(str(model_dir / "1" / "model.pt"), map_location="cpu")
    state = {k: v.detach().numpy() for k, v in module.state_dict().items()}
    inits = [
        numpy_helper.from_array(state["mean"], "mean"),
        numpy_helper.from_array(state["std"], "std"),
    ]
    nodes = []
    columns = []
    for i, field in enumerate(INPUTS):
        cast = f"{field.name}_f"
        nodes.append(helper.make_node("Cast", [field.name], [cast], to=TensorProto.FLOAT))
        if i == 1:  # monthly_spend goes in as log1p
            inits.append(numpy_helper.from_array(np.array([1.0], dtype=np.float32), "one"))
            nodes.append(helper.make_node("Add", [cast, "one"], [f"{cast}_1"]))
            nodes.append(helper.make_node("Log", [f"{cast}_1"], [f"{cast}_log"]))
            cast = f"{cast}_log"
        columns.append(cast)
    nodes.append(helper.make_node("Concat", columns, ["features"], axis=1))
    nodes.append(helper.make_node("Sub", ["features", "mean"], ["centred"]))
    nodes.append(helper.make_node("Div", ["centred", "std"], ["h0"]))
    layers = [0, 2, 4]  # nn.Sequential indices of the Linear layers
    for n, index in enumerate(layers):
        weight, bias = f"layers.{index}.weight", f"layers.{index}.bias"
        inits += [
            numpy_helper.from_array(state[weight], weight),
            numpy_helper.from_array(state[bias], bias),
        ]
        out = f"g{n}"
        nodes.append(helper.make_node("Gemm", [f"h{n}", weight, bias], [out], transB=1))
        if n < len(layers) - 1:
            nodes.append(helper.make_node("Relu", [out], [f"h{n + 1}"]))
    nodes.append(helper.make_node("Sigmoid", [f"g{len(layers) - 1}"], ["churn_probability"]))
    types = {"INT64": TensorProto.INT64, "FP32": TensorProto.FLOAT}
    graph = helper.make_graph(
        nodes,
        "churn_mlp",
        [helper.make_tensor_value_info(f.name, types[f.datatype], [None, 1]) for f in INPUTS],
        [helper.make_tensor_value_info("churn_probability", TensorProto.FLOAT, [None, 1])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (onnx_dir / "1").mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(onnx_dir / "1" / "model.onnx"))
    text = (model_dir / "model.yaml").read_text().replace("runtime: torch", "runtime: onnx")
    (onnx_dir / "model.yaml").write_text(text)


if __name__ == "__main__":
    sys.exit(main())
