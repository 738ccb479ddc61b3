"""The phases of benchmarks/gpu_check.py (see its docstring) and the timing they share. Each phase returns plain
data for the report."""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch
from gpu_models import FLUX_DEV, build_sd15, build_tiny

from stepserve import Engine
from stepserve.backends.fast_path import FastPathOptions

STRATEGIES = ("continuous", "dynamic", "static", "none")  # what the strategies phase compares


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int, warmup: int = 1) -> float:
    """Median seconds of fn() over `repeats` runs, the device synchronised around each."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def peak_flops(device: str, dtype: torch.dtype, smoke: bool) -> float:
    """FLOP/s of a large square matmul in `dtype` on the device: the peak utilisation is quoted against."""
    n = 512 if smoke else 8192
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / timed(lambda: a @ b, device, repeats=3 if smoke else 10, warmup=2)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


class Recorder:
    """Stands in for the wrapper's padded denoiser call and keeps the last arguments (already padded to a bucket),
    so the bare forward can be timed on exactly what the engine ran."""

    def __init__(self, fn) -> None:
        self.fn, self.last = fn, None

    def __call__(self, *args, **kwargs):
        self.last = (args, kwargs)
        return self.fn(*args, **kwargs)


def requests_for(executor, n: int, steps: int = 50):
    """n prepared throwaway requests without guidance (one denoiser row each), at the model's default size."""
    from stepserve.request.types import Request, SamplingParams
    from stepserve.request.validation import resolve_params

    p = resolve_params(SamplingParams(prompt="a photograph", seed=1, num_inference_steps=steps, guidance_scale=1.0),
                       executor.model_info)
    requests = [Request(f"check-{n}-{i}", p, 0.0, (p.height, p.width), steps) for i in range(n)]
    executor.prepare(requests)
    return requests


def flops_per_row(inner_denoise, args, kwargs) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    one = tuple(a[:1] if isinstance(a, torch.Tensor) and a.dim() else a for a in args)
    kw = {k: v[:1] if k not in ("img_ids", "txt_ids") and isinstance(v, torch.Tensor) and v.dim() else v
          for k, v in kwargs.items()}
    with FlopCounterMode(display=False) as counter:
        inner_denoise(*one, **kw)
    return float(counter.get_total_flops())


def permuted_rows(wrapper, args, kwargs) -> int:
    """--deterministic rests on this: at a fixed shape a row's output depends on that row alone. Runs the eager and
    the compiled denoiser on the rows and on the rows reversed; counts rows whose output is not bitwise the same."""
    n = args[0].shape[0]
    flip = torch.arange(n - 1, -1, -1, device=args[0].device)

    def rev(v, name=None):
        batched = isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n and name not in ("img_ids", "txt_ids")
        return v[flip] if batched else v

    differing = 0
    for fn in (wrapper.inner.denoise, wrapper._denoise.fn):
        outs = []
        for a, kw in ((args, kwargs), (tuple(rev(v) for v in args), {k: rev(v, k) for k, v in kwargs.items()})):
            if fn is not wrapper.inner.denoise and wrapper.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad():
                out = fn(*a, **kw)
            outs.append((out if isinstance(out, torch.Tensor) else out[0]).clone())
        differing += sum(not torch.equal(outs[0][k], outs[1][n - 1 - k]) for k in range(n))
    return differing


def run_phases(args, device: str, dtype: str) -> dict:
    t_start = time.monotonic()
    notes: list[str] = []
    checks: list[dict] = []
    report: dict = {"checks": checks, "notes": notes, "forward": [], "strategies": []}

    def time_left(phase: str, need_s: float = 0.0) -> bool:
        """Whether `phase` (about need_s seconds on the GPU) can still finish inside --budget-s."""
        elapsed = time.monotonic() - t_start
        if not smoke and elapsed + need_s > args.budget_s:
            notes.append(f"{phase}: skipped at {elapsed:.0f} s, it needs about {need_s:.0f} s of --budget-s "
                         f"{args.budget_s:g} s")
            return False
        return True

    def check(name: str, value: float, limit: float) -> None:
        checks.append({"name": name, "value": value, "limit": limit, "ok": bool(value <= limit)})

    smoke = args.smoke
    buckets = (4,) if smoke else (1, 2, 4, 8, 16, 32)
    max_batch = 2 if smoke else 16  # requests; guidance doubles the rows (32)
    folder = Path(tempfile.mkdtemp(prefix="gpu-check-")) / "model"
    t0 = time.monotonic()
    build_tiny(folder) if smoke else build_sd15(folder, getattr(torch, dtype), device)
    build_s = time.monotonic() - t0
    # 1-3. engines: the compiled one serves; an eager one of the same dtype and a float32 one check numerics
    t0 = time.monotonic()
    fast = FastPathOptions(compile=True, batch_buckets=buckets, compile_backend=args.compile_backend, progress=True)
    engine = Engine.from_pretrained(str(folder), device=device, dtype=dtype, memory_cap=False,
                                    max_batch_size=max_batch, fast_path=fast)
    compile_s = time.monotonic() - t0
    executor, wrapper = engine.executor, engine.executor.pipeline.networks
    recorder = wrapper._denoise = Recorder(wrapper._denoise)
    on_cuda = device.startswith("cuda")
    report["environment"] = {
        "model": "tiny SD (smoke)" if smoke else "SD-1.5-sized (random weights)", "device": device, "dtype": dtype,
        "device_name": torch.cuda.get_device_name() if on_cuda else "cpu", "torch": torch.__version__,
        "buckets": list(buckets), "build_s": build_s, "load_compile_warmup_s": compile_s,
        "peak_tflops": peak_flops(device, getattr(torch, dtype), smoke) / 1e12}
    peak = report["environment"]["peak_tflops"] * 1e12

    executor.denoise(requests_for(executor, 3))  # 3 rows, padded to a bucket of 4
    (pargs, pkwargs) = recorder.last
    with torch.no_grad():
        compiled_out = recorder.fn(*pargs, **pkwargs)
        compiled_out = compiled_out.clone() if isinstance(compiled_out, torch.Tensor) else compiled_out[0].clone()
        eager_out = wrapper.inner.denoise(*pargs, **pkwargs)
    # Limits catch gross errors (a leaked padding row, a wrong layout: errors of order 1), not rounding drift:
    # float32 convolutions run in TF32 on CUDA by default, and 16-bit formats keep 8 (bf16) or 11 (fp16) bits.
    limits = {"float32": 1e-2 if on_cuda else 1e-4, "float16": 2e-2, "bfloat16": 6e-2}
    check(f"compiled vs eager ({dtype}), rel max err", rel_err(compiled_out, eager_out), limits[dtype])
    check("fixed-shape rows that change when the rows are permuted", permuted_rows(wrapper, pargs, pkwargs), 0)
    if dtype != "float32" and time_left("half vs float32", 30):
        ref = Engine.from_pretrained(str(folder), device=device, dtype="float32", memory_cap=False, max_batch_size=2)
        up = lambda v: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
        with torch.no_grad():
            f32 = ref.executor.pipeline.networks.denoise(*map(up, pargs), **{k: up(v) for k, v in pkwargs.items()})
        check(f"{dtype} vs float32 denoiser, rel max err", rel_err(eager_out, f32), 3 * limits[dtype])
        del ref

    # 4. latency model of the compiled engine
    if time_left("profile", 60):
        from stepserve.profiling import measure_latency_model

        model = measure_latency_model(executor, max_batch, repeats=3, progress=True)
        model.save(args.out / "latency_model.json")
        notes.append(f"latency model: {args.out / 'latency_model.json'} (stepserve simulate --latency-model)")

    # 5. bare compiled forward vs the engine's step, and MFU
    if time_left("bare vs engine", 20):
        per_row = None
        for rows in ((1, 2, 4) if smoke else (1, 2, 8, 16, 32)):
            requests = requests_for(executor, rows)
            engine_s = timed(lambda: executor.denoise(requests), device, repeats=5)
            bargs, bkwargs = recorder.last
            per_row = per_row or flops_per_row(wrapper.inner.denoise, bargs, bkwargs)

            def bare():
                if wrapper.cuda_graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                with torch.no_grad():
                    recorder.fn(*bargs, **bkwargs)

            bare_s = timed(bare, device, repeats=5)
            steps = requests[0].num_inference_steps
            report["forward"].append({"rows": rows, "bare_s": bare_s, "engine_s": engine_s,
                                      "engine_over_bare": engine_s / bare_s, "flops_per_row": per_row,
                                      "images_per_s_step": rows / (engine_s * steps),
                                      "mfu": per_row * rows / bare_s / peak})
        notes.append("img/s (step): requests x 1 row each / (engine step x 50 steps), denoising only; MFU: FLOPs of "
                     "the bare forward's real rows / its time / the timed matmul peak")

    # 6. strategy comparison on the same compiled engine
    if time_left("strategies", 110):
        report["strategies"] = strategies(args, executor, folder, device, dtype, smoke)
    # 7. other weights: --quantize (int8 weight-only everywhere, float8 weight-only on CUDA) and --offload (CUDA)
    if time_left("weights", 90):
        report["weights"] = weight_variants(folder, device, dtype, smoke, executor, eager_out, pargs, pkwargs)
    # 8. flux-sized transformer
    if (ROOT_FLUX.is_file() and on_cuda and not smoke) and time_left("flux", 150):
        report["flux"] = flux_forward(device, getattr(torch, dtype), peak)
        notes.append(f"flux (bare transformer, 512x512, 512 text tokens): {report['flux']}")
    elif not ROOT_FLUX.is_file() or not on_cuda or smoke:
        notes.append("flux: not run (needs stepserve/pipelines/flux.py and a GPU, and not --smoke)")
    # 9. one request over two devices (gpu_check_parallel.py)
    if time_left("parallel", 120):
        from gpu_check_parallel import parallel_rows

        report["parallel"] = parallel_rows(device, dtype, smoke, check, notes)
    report["wall_s"] = time.monotonic() - t_start
    return report


ROOT_FLUX = Path(__file__).resolve().parent.parent / "stepserve" / "pipelines" / "flux.py"


def weight_variants(folder: Path, device: str, dtype: str, smoke: bool, executor, eager_out, pargs, pkwargs
                    ) -> list[dict]:
    """Per --quantize type and --offload mode the device runs: the denoiser's relative error against the eager one
    of the same dtype on the check's recorded rows, an engine step at batch 1 and 8 against the check's (compiled)
    engine, and the device memory those steps hold at their peak beyond what was allocated before the variant
    loaded (CUDA: its weights on the device and its activations). Offloading moves the denoiser's weights once per
    step whatever the batch, so its step ratio should fall from batch 1 to 8."""
    from stepserve.engine.loading import load_executor
    from stepserve.pipelines.weights import Weights

    cuda = device.startswith("cuda")
    variants = [("--quantize int8wo", Weights(quantize="int8wo"))]
    if cuda:
        variants += [("--quantize float8wo", Weights(quantize="float8wo")),
                     ("--offload model", Weights(offload="model")), ("--offload group", Weights(offload="group"))]
    rows = []
    for label, weights in variants:
        before = torch.cuda.memory_allocated() if cuda else 0
        try:
            q = load_executor(str(folder), device, dtype, weights=weights)
        except (ImportError, ValueError) as exc:
            rows.append({"type": label, "error": str(exc)[:200]})
            continue
        with torch.no_grad():
            out = q.pipeline.networks.denoise(*pargs, **pkwargs)
        row = {"type": label, "rel_err_vs_unquantized": rel_err(out if isinstance(out, torch.Tensor) else out[0],
                                                                eager_out)}
        for batch in ((1, 2) if smoke else (1, 8)):
            base, quant = requests_for(executor, batch), requests_for(q, batch)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            row[f"step_s_b{batch}"] = timed(lambda: q.denoise(quant), device, repeats=3)
            if cuda:
                row["peak_mb"] = max(row.get("peak_mb", 0.0), (torch.cuda.max_memory_allocated() - before) / 2**20)
            row[f"unquantized_step_s_b{batch}"] = timed(lambda: executor.denoise(base), device, repeats=3)
        rows.append(row)
        del q
    return rows


def strategies(args, executor, folder: Path, device: str, dtype: str, smoke: bool) -> list[dict]:
    """`stepserve bench` on the already compiled executor (its loader is pointed at it, so nothing recompiles)."""
    from stepserve.bench import live_bed
    from stepserve.bench.app import run_bench
    from stepserve.commands.bench import config_from_args

    duration = args.bench_duration or (2.0 if smoke else 12.0)
    argv = ["--model", str(folder), "--device", device, "--dtype", dtype, "--strategies", ",".join(STRATEGIES),
            "--max-batch-size", "2" if smoke else "16", "--duration", str(duration), "--warmup", str(duration / 4),
            "--steps", "2,4" if smoke else "20,30", "--out", str(args.out / "bench"), "--no-progress",
            "--dynamic-delays-ms", "50"]
    argv += ["--rate", "4"] if smoke else ["--rate-frac", "0.7", "--capacity-duration", "6"]
    cfg = config_from_args(argv)
    loader, live_bed.load_model = live_bed.load_model, lambda *a, **k: executor
    try:
        run = asyncio.run(run_bench(cfg))
    finally:
        live_bed.load_model = loader
    return [{"strategy": s.contender, "images_per_s": s.throughput_rps.median or 0.0, "p50_s": s.p50_s.median,
             "p95_s": s.p95_s.median, "mean_batch": s.mean_batch_size.median or 0.0} for s in run.results.summaries]


def flux_forward(device: str, dtype: torch.dtype, peak: float) -> dict:
    from diffusers import FluxTransformer2DModel

    with torch.device(device):
        transformer = FluxTransformer2DModel(**FLUX_DEV).to(dtype).eval()
    g = dict(device=device, dtype=dtype)

    def inputs(rows: int) -> dict:  # 512x512: 64x64 latents packed 2x2 -> 1024 tokens; 512 T5 tokens
        return dict(hidden_states=torch.randn(rows, 1024, 64, **g), timestep=torch.full((rows,), 0.5, **g),
                    guidance=torch.full((rows,), 3.5, **g), pooled_projections=torch.randn(rows, 768, **g),
                    encoder_hidden_states=torch.randn(rows, 512, 4096, **g), img_ids=torch.zeros(1024, 3, **g),
                    txt_ids=torch.zeros(512, 3, **g), return_dict=False)

    out = {}
    compiled = torch.compile(transformer, dynamic=False)
    with torch.no_grad():
        for rows in (1, 4):
            kwargs = inputs(rows)
            out[f"eager_ms@{rows}"] = timed(lambda: transformer(**kwargs), device, repeats=3) * 1e3
        kwargs = inputs(1)
        out["compiled_ms@1"] = timed(lambda: compiled(**kwargs), device, repeats=3, warmup=2) * 1e3
    sync(device)
    return out
