"""Inference engine benchmark: every available backend x precision on this machine.

For each engine built by :func:`beatflow.engine.cache.build_or_load_engine`:

* accuracy against the fp32 PyTorch scorer on labelled synthetic beats (``synthesize_ecg`` + the
  pipeline's segmentation, beats matched to the truth within 150 ms): max abs / relative score
  error, max abs ``mu`` error, anomaly ROC-AUC (PVC + artifact vs normal) and its change;
* latency p50/p99 of one beat (batch 1);
* throughput for batches 1, 2, 4 ... 8192 (``engine.infer(X, batch_size=b)`` over enough rows to
  take ~0.3 s; best of 3);
* on a GPU: inputs are device tensors (zero copy), timed with CUDA events, and the CUDA memcpy
  traffic during a device-input ``infer`` is counted with the PyTorch (CUPTI) profiler;
* on the CPU: an ONNX Runtime configuration sweep at batch 1024 (threads, feeding, spinning,
  graph optimization level, memory arena, execution mode, graph rewrites).

Usage::

    .venv/bin/python bench/engine_bench.py --out /tmp/engine-bench            # CPU
    .venv/bin/python bench/engine_bench.py --device cuda --out $OUT            # GPU (all backends)
    .venv/bin/python bench/engine_bench.py --quick                             # smoke run

Writes ``engine_bench.json`` and ``engine_bench.md`` to ``--out`` (on a GPU: ``bash bench/gpu.sh engine``;
results: ``bench/results/engine.md``).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402

import common  # noqa: E402

from beatflow.engine import cache as engines  # noqa: E402
from beatflow.engine import options  # noqa: E402
from beatflow.engine.onnx import OnnxRuntimeEngine, export_onnx  # noqa: E402
from beatflow.engine.options import PRECISIONS  # noqa: E402
from beatflow.model.threads import torch_threads  # noqa: E402
from beatflow.score.metrics import roc_auc  # noqa: E402

BATCHES = [1 << k for k in range(14)]  # 1 .. 8192


# ----------------------------------------------------------------------------------------------
# data and model
# ----------------------------------------------------------------------------------------------

def labelled_beats(hours: float, seed: int):
    """Scaled beat rows of a synthetic ECG (pipeline segmentation) and their truth labels
    (0 normal, 1 PVC, 2 artifact, -1 no true beat within 150 ms)."""
    from beatflow.embed import embed
    from beatflow.embed.beats import beats_from_peaks, prune_mask
    from beatflow.score.metrics import match_beats
    from beatflow.params import SegmentParams
    from beatflow.detect import detect_peaks
    from beatflow.io.synth import synthesize_ecg

    ecg = synthesize_ecg(hours=hours, fs=250.0, seed=seed)
    s = SegmentParams().samples(ecg.fs)
    peaks = detect_peaks(ecg.signal, s)
    peak, start, length = beats_from_peaks(peaks, s, len(ecg.signal))
    keep = prune_mask(length, s.lower, s.upper)
    rows, p2p = embed(ecg.signal, start[keep], length[keep], s.width, baseline_samples=max(1, s.pre // 2))
    rows /= np.float32(np.median(p2p))
    _, m = match_beats(peak[keep], ecg.r_peaks, int(round(0.15 * ecg.fs)))
    labels = np.full(len(rows), -1, np.int64)
    labels[m[m >= 0]] = ecg.labels[m >= 0]
    return np.ascontiguousarray(rows, dtype=np.float32), labels


def train(rows: np.ndarray, epochs: int, out: Path, seed: int):
    from beatflow.model.train import train_vae
    from beatflow.model.vae import save_model

    with torch_threads(1):
        res = train_vae(rows, epochs=epochs, batch_size=1024, seed=seed)
    path = out / "model.pt"
    save_model(res.model, path)
    rng = np.random.default_rng(seed)
    val_idx = np.sort(rng.choice(res.test_index, size=min(4096, len(res.test_index)), replace=False))
    return str(path), res, rows[val_idx]


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------

def Timer(gpu: bool):
    """Seconds of ``fn()``: CUDA events on a GPU, the monotonic clock on the CPU (``beatflow.engine.validate.timer``)."""
    from beatflow.engine.validate import timer

    return timer(gpu)


def to_engine_input(engine, x: np.ndarray):
    if engine.on_gpu:
        return torch.from_numpy(x).to(torch.device("cuda", getattr(engine, "device_index", 0) or 0))
    return x


def latency(engine, x: np.ndarray, timer, calls: int) -> dict:
    """Batch-1 latency p50/p99 as every engine step measures it (:func:`beatflow.engine.validate.profile_engine`)."""
    from beatflow.engine.validate import profile_engine

    lat = profile_engine(engine, x[:64], (), latency_calls=calls, min_rows=1)["latency_batch1_us"]
    return {"p50_us": lat["p50"], "p99_us": lat["p99"], "calls": lat["calls"]}


def tput_curve(engine, pool: np.ndarray, timer, batches, target_s: float, max_rows: int) -> dict:
    out = {}
    dev_pool = to_engine_input(engine, pool)
    for b in batches:
        if b > engine.max_batch:
            continue
        probe = dev_pool[: min(len(pool), 4 * b)]
        engine.infer(probe, batch_size=b)  # warm-up (allocations for this shape)
        per_row = timer(lambda: engine.infer(probe, batch_size=b)) / probe.shape[0]
        rows = int(min(max_rows, len(pool), max(b, target_s / max(per_row, 1e-9))))
        rows = max(b, rows // b * b)
        x = dev_pool[:rows]
        ts = [timer(lambda: engine.infer(x, batch_size=b)) for _ in range(3)]
        out[b] = {"beats_per_s": rows / min(ts), "median_beats_per_s": rows / float(np.median(ts)), "rows": rows}
    return out


def memcpy_traffic(engine, x: np.ndarray) -> dict:
    """CUDA memcpy activity (CUPTI, process-wide: ORT and TensorRT included) during one ``infer``
    of a device tensor; 'HtoD' > 0 would mean the input went through the host."""
    from torch.profiler import ProfilerActivity, profile

    xd = to_engine_input(engine, x)
    engine.infer(xd)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        s, m = engine.infer(xd)
        torch.cuda.synchronize()
    counts: dict = {}
    kernels = 0
    for e in prof.events():
        name = e.name
        if "Memcpy" in name or "memcpy" in name:
            key = "HtoD" if "HtoD" in name else "DtoH" if "DtoH" in name else "DtoD" if "DtoD" in name else name
            counts[key] = counts.get(key, 0) + 1
        elif getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
            kernels += 1
    # kernels > 0 shows the profiler saw the GPU work, so an empty memcpy count means none happened
    return {"memcpy_events": counts, "cuda_kernel_events": kernels,
            "result_is_cuda_tensor": isinstance(s, torch.Tensor) and s.is_cuda}


# ----------------------------------------------------------------------------------------------
# ONNX Runtime configuration sweep (CPU)
# ----------------------------------------------------------------------------------------------

def ort_sweep(scorer, pool: np.ndarray, threads: int, tmp: Path, batch: int = 1024, seconds: float = 0.5,
              rounds: int = 5) -> list[dict]:
    """Beats/s at ``batch`` for ONNX Runtime session configurations (interleaved rounds, best and
    median per configuration, so a busy machine hurts all alike)."""
    plain = export_onnx(scorer, tmp / "plain.onnx")
    fast = export_onnx(scorer, tmp / "rewritten.onnx", optimize=True)
    n = threads
    configs = [
        ("plain graph, intra-op threads=%d, 1 feeder (seed's setup)" % n, plain, dict(intra_op_num_threads=n)),
        ("plain, intra=%d, spinning off" % n, plain, dict(intra_op_num_threads=n, allow_spinning=False)),
        ("plain, intra=1, 1 feeder (one core)", plain, dict(intra_op_num_threads=1)),
        ("plain, intra=1, %d concurrent feeders" % n, plain, dict(intra_op_num_threads=1, feeders=n)),
        ("plain, intra=%d, inter=%d, parallel execution mode" % (n, n), plain,
         dict(intra_op_num_threads=n, session_options={"execution_mode": "parallel", "inter_op_num_threads": n})),
        ("plain, intra=1 x%d feeders, graph level 'extended'" % n, plain,
         dict(intra_op_num_threads=1, feeders=n, graph_optimization_level="extended")),
        ("plain, intra=1 x%d feeders, graph level 'basic'" % n, plain,
         dict(intra_op_num_threads=1, feeders=n, graph_optimization_level="basic")),
        ("plain, intra=1 x%d feeders, cpu mem arena off" % n, plain,
         dict(intra_op_num_threads=1, feeders=n, session_options={"enable_cpu_mem_arena": False})),
        ("rewritten graph, intra=%d, 1 feeder" % n, fast, dict(intra_op_num_threads=n)),
        ("rewritten, intra=1, 1 feeder (one core)", fast, dict(intra_op_num_threads=1)),
        ("rewritten, intra=1, %d concurrent feeders (default)" % n, fast, dict(intra_op_num_threads=1, feeders=n)),
    ]
    engines_ = [(name, OnnxRuntimeEngine.load(path, **kw)) for name, path, kw in configs]
    rows = None
    results = {name: [] for name, _ in engines_}
    for name, eng in engines_:  # size the run once per config (~seconds)
        eng.infer(pool[:batch], batch)
        t0 = time.perf_counter()
        eng.infer(pool[: 4 * batch], batch)
        per = (time.perf_counter() - t0) / (4 * batch)
        rows = max(rows or 0, int(seconds / per))
    rows = min(len(pool), max(batch, rows // batch * batch))
    x = pool[:rows]
    cpu = {name: [] for name, _ in engines_}
    for _ in range(rounds):
        for name, eng in engines_:
            c0, t0 = time.process_time(), time.perf_counter()
            eng.infer(x, batch)
            results[name].append(rows / (time.perf_counter() - t0))
            cpu[name].append(rows / max(time.process_time() - c0, 1e-9))
    # beats per CPU-second (all threads of this process): what a core does when it is not taken
    # away by other processes; x cores = a dedicated machine's throughput if threads scale
    return [{"config": name, "best_beats_per_s": max(v), "median_beats_per_s": float(np.median(v)), "rows": rows,
             "rounds": rounds, "beats_per_cpu_s": float(np.median(cpu[name]))} for name, v in results.items()]


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------

def machine(device: str) -> dict:
    info = {"date": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "host": platform.node(),
            "cpu": engines.device_name("cpu"), "cores": engines._usable_cores(), "python": platform.python_version(),
            "versions": engines.library_versions(device), "loadavg_start": os.getloadavg(),
            "header": common.machine()}
    if device != "cpu":
        info["gpu"] = engines.device_name(device)
    return info


def combos(device: str, backends, precisions):
    avail = options.available_backends(device)
    gpu = device != "cpu"
    for b in backends:
        for p in precisions:
            if not options._supports(b, p, gpu):
                continue
            yield b, p, (b in avail)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for engine_bench.json / .md (default: a temp folder)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    ap.add_argument("--backends", default="all", help="comma list of onnxruntime,aoti,tensorrt or 'all'")
    ap.add_argument("--precisions", default="all", help="comma list of fp32,fp16,bf16,int8 or 'all'")
    ap.add_argument("--aoti-cpu", action="store_true", help="also AOTInductor on the CPU (compiles ~1.5 min)")
    ap.add_argument("--hours", type=float, default=2.0, help="synthetic ECG length (default 2 h)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="CPU inference threads (default: usable cores)")
    ap.add_argument("--cache-dir", default=None, help="engine cache (default: <out>/engine-cache, fresh builds)")
    ap.add_argument("--target-s", type=float, default=0.3, help="seconds per throughput measurement")
    ap.add_argument("--max-rows", type=int, default=1 << 17)
    ap.add_argument("--latency-calls", type=int, default=2000)
    ap.add_argument("--no-sweep", action="store_true", help="skip the ONNX Runtime configuration sweep (CPU)")
    ap.add_argument("--sweep-only", action="store_true", help="CPU: only the ONNX Runtime configuration sweep")
    ap.add_argument("--quick", action="store_true", help="smoke run: 0.25 h, 2 epochs, few batches")
    args = ap.parse_args(argv)

    if args.quick:
        args.hours, args.epochs, args.latency_calls, args.target_s = 0.25, 2, 200, 0.05
    out = Path(args.out or tempfile.mkdtemp(prefix="engine-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    device = options.normalize_device(args.device)
    gpu = device != "cpu"
    threads = args.threads or engines._usable_cores()
    cache = Path(args.cache_dir) if args.cache_dir else out / "engine-cache"
    backends = options.BACKENDS if args.backends == "all" else tuple(args.backends.split(","))
    precisions = PRECISIONS if args.precisions == "all" else tuple(args.precisions.split(","))
    batches = [1, 16, 256, 1024, 8192] if args.quick else BATCHES
    report = {"command": " ".join([sys.executable, *sys.argv]), "machine": machine(device), "device": device,
              "threads": threads, "results": [], "skipped": []}
    print(f"machine: {report['machine']['cpu']}, {threads} threads" + (f", {report['machine']['gpu']}" if gpu else ""))

    t0 = time.perf_counter()
    rows, labels = labelled_beats(args.hours, args.seed)
    model_path, res, val = train(rows, args.epochs, out, args.seed)
    from beatflow.model.vae import Scorer, load_model, score_beats

    scorer = Scorer(load_model(model_path)).eval()
    with torch_threads(1):
        ref_s, ref_mu = score_beats(scorer, rows)
    ok = labels >= 0
    auc_ref = roc_auc(ref_s[ok], labels[ok] > 0)
    report["data"] = {"beats": int(len(rows)), "width": int(rows.shape[1]), "labelled": int(ok.sum()),
                      "pvc": int((labels == 1).sum()), "artifact": int((labels == 2).sum()),
                      "validation_beats": int(len(val)), "test_loss": res.test_loss, "auc_pytorch_fp32": auc_ref,
                      "score_range": [float(ref_s.min()), float(ref_s.max())], "prep_s": time.perf_counter() - t0}
    print(f"data: {len(rows)} beats ({report['data']['pvc']} PVC, {report['data']['artifact']} artifacts), "
          f"PyTorch fp32 ROC-AUC {auc_ref:.5f}, prep {report['data']['prep_s']:.0f} s")
    pool = np.concatenate([rows] * int(np.ceil(args.max_rows / len(rows))))[: args.max_rows]
    timer = Timer(gpu)

    todo = [] if args.sweep_only else list(combos(device, backends, precisions))
    if not gpu and "aoti" in backends and not args.aoti_cpu and not args.sweep_only:
        todo = [c for c in todo if c[0] != "aoti"]
        report["skipped"].append({"backend": "aoti", "precision": "*", "reason": "CPU: pass --aoti-cpu (slow compile)"})
    for backend, precision, available in todo:
        label = f"{backend} {precision}"
        if not available:
            report["skipped"].append({"backend": backend, "precision": precision, "reason": "not available here"})
            print(f"{label}: not available here")
            continue
        try:
            t = time.perf_counter()
            engine, info = engines.build_or_load_engine(model_path, val, backend=backend, precision=precision,
                                                        device=device, cache_dir=cache, threads=threads)
            build_s = time.perf_counter() - t
            s, mu = engine.infer(to_engine_input(engine, rows))
            s, mu = (v.cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for v in (s, mu))
            err = np.abs(s.astype(np.float64) - ref_s)
            auc = roc_auc(s[ok], labels[ok] > 0)
            r = {"backend": backend, "precision": precision, "cache": info["cache"], "build_s": build_s,
                 "key": info["key"], "path": info["path"],
                 "accuracy": {"max_abs_err": float(err.max()), "max_rel_err": float((err / np.abs(ref_s)).max()),
                              "max_abs_err_mu": float(np.abs(mu - ref_mu).max()),
                              "validation_max_abs_err": info["max_abs_err"], "tolerance": info["tolerance"],
                              "auc": auc, "delta_auc": auc - auc_ref},
                 "latency_batch1": latency(engine, rows, timer, args.latency_calls),
                 "throughput": tput_curve(engine, pool, timer, batches, args.target_s, args.max_rows)}
            if gpu:
                try:
                    r["zero_copy"] = memcpy_traffic(engine, rows[:4096])
                except Exception as e:  # profiler unavailable
                    r["zero_copy"] = {"error": f"{e.__class__.__name__}: {e}"}
            report["results"].append(r)
            tp = r["throughput"].get(1024, {}).get("beats_per_s", float("nan"))
            print(f"{label}: {info['cache']} in {build_s:.1f} s, max abs err {r['accuracy']['max_abs_err']:.1e}, "
                  f"dAUC {r['accuracy']['delta_auc']:+.1e}, p50 {r['latency_batch1']['p50_us']:.0f} us, "
                  f"{tp:,.0f} beats/s @1024")
        except Exception as e:
            report["skipped"].append({"backend": backend, "precision": precision,
                                      "reason": f"{e.__class__.__name__}: {e}".splitlines()[0]})
            print(f"{label}: FAILED {e.__class__.__name__}: {e}")
            traceback.print_exc()

    if not gpu and not args.no_sweep and "onnxruntime" in backends:
        print("ONNX Runtime configuration sweep at batch 1024 ...")
        with tempfile.TemporaryDirectory() as tmp:
            report["ort_sweep"] = ort_sweep(scorer, pool, threads, Path(tmp),
                                            seconds=0.1 if args.quick else 0.5, rounds=2 if args.quick else 5)
    report["machine"]["loadavg_end"] = os.getloadavg()
    report["total_s"] = time.perf_counter() - t0
    md = markdown(report, batches)
    (out / "engine_bench.json").write_text(json.dumps(report, indent=1, default=float))
    (out / "engine_bench.md").write_text(md)
    print()
    print(md)
    print(f"wrote {out / 'engine_bench.json'} and {out / 'engine_bench.md'}")
    return 0


def markdown(rep: dict, batches) -> str:
    m = rep["machine"]
    lines = [f"## Engine benchmark, {m['date']}", "", common.header(info=m["header"]),
             f"- command: `{rep['command']}`",
             f"- machine: {m['cpu']}, {rep['threads']} threads" + (f", GPU {m['gpu']}" if "gpu" in m else ""),
             f"- load average at start/end: {m['loadavg_start'][0]:.1f} / {m['loadavg_end'][0]:.1f}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()),
             f"- data: {rep['data']['beats']} synthetic beats ({rep['data']['pvc']} PVC, {rep['data']['artifact']} "
             f"artifacts, {rep['data']['labelled']} matched to the truth), PyTorch fp32 ROC-AUC "
             f"{rep['data']['auc_pytorch_fp32']:.5f}, scores {rep['data']['score_range'][0]:.3g}.."
             f"{rep['data']['score_range'][1]:.3g}", "",
             "### Accuracy against PyTorch fp32 (all beats) and latency", ""]
    acc = []
    for r in rep["results"]:
        a, lt = r["accuracy"], r["latency_batch1"]
        acc.append((r["backend"], r["precision"], f"{r['cache']} {r['build_s']:.1f} s", f"{a['max_abs_err']:.1e}",
                    f"{a['max_rel_err']:.1e}", f"{a['max_abs_err_mu']:.1e}", f"{a['auc']:.5f}", f"{a['delta_auc']:+.1e}",
                    f"{lt['p50_us']:.0f} us", f"{lt['p99_us']:.0f} us"))
    lines.append(common.markdown_table(["backend", "precision", "build", "max abs err", "max rel err", "max abs err mu",
                                        "ROC-AUC", "dAUC", "p50 batch 1", "p99 batch 1"], acc))
    lines += ["", "### Throughput (beats/s, best of 3; `engine.infer(X, batch_size=b)`)", "",
              common.markdown_table(["batch"] + [f"{r['backend']} {r['precision']}" for r in rep["results"]],
                                    [[b] + [f"{r['throughput'][b]['beats_per_s']:,.0f}" if b in r["throughput"] else "-"
                                            for r in rep["results"]] for b in batches])]
    if any("zero_copy" in r for r in rep["results"]):
        lines += ["", "### Device input (zero copy): CUDA memcpy events during one infer of a device tensor", ""]
        for r in rep["results"]:
            if "zero_copy" in r:
                lines.append(f"- {r['backend']} {r['precision']}: {r['zero_copy']}")
    if rep.get("ort_sweep"):
        lines += ["", f"### ONNX Runtime configurations, batch 1024, {rep['threads']} threads "
                      f"({rep['ort_sweep'][0]['rounds']} interleaved rounds of {rep['ort_sweep'][0]['rows']} beats)", "",
                  common.markdown_table(["configuration", "best beats/s", "median beats/s",
                                         "beats per CPU-second (median)"],
                                        [(c["config"], f"{c['best_beats_per_s']:,.0f}", f"{c['median_beats_per_s']:,.0f}",
                                          f"{c.get('beats_per_cpu_s', float('nan')):,.0f}") for c in rep["ort_sweep"]])]
    if rep["skipped"]:
        lines += ["", "### Not measured", ""] + [f"- {s['backend']} {s['precision']}: {s['reason']}" for s in rep["skipped"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
