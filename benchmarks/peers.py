"""stepserve serve (continuous batching, one replica) against peer servers on one open-loop trace, and each peer's
overhead per request at idle.

1. `stepserve bench --peers PEERS` (every contender its own server on loopback, the same model, networks,
   samplers and threads; only the batching differs): the SLO is 2x the idle latency of the longest request
   through stepserve serve, capacity is stepserve serve's, and one seeded Poisson trace at --rate-frac of it is
   replayed against stepserve serve and every peer at every setting (bare peer names: max batch 4/8 x wait
   10/50 ms). Goodput within the SLO: stepserve's against each peer's best setting.
2. Idle overhead: for stepserve serve and each peer (at --idle-setting), one request at a time, alternating with
   the same request run by the bare pipeline in this process (the same backend and threads, the engine with no
   batching); overhead = median(served) - median(bare). A batching peer's lone request also waits out its batch
   wait.

    python benchmarks/peers.py --out bench-out/peers --peers triton,ray,litserve --duration 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from common import add_run_args, stepserve

from stepserve.bench.peers import PeerSetting, parse_peers
from stepserve.bench.peers.handler import HandlerOptions
from stepserve.bench.peers.registry import PeerContext
from stepserve.bench.peers.target import PeerTarget
from stepserve.bench.targets import OK
from stepserve.bench.workload import RequestSpec


def goodput_table(results: dict) -> dict[str, tuple[str, float]]:
    """{family: (best contender, its goodput)} from a --peers results.json."""
    family = {p["name"]: p["peer"] for p in results["settings"]["peers"]}
    best: dict[str, tuple[str, float]] = {}
    for s in results["summaries"]:
        name, value = s["contender"], s["goodput_rps"]["median"] or 0.0
        fam = family[name]
        if fam not in best or value > best[fam][1]:
            best[fam] = (name, value)
    return best


def bare_pipeline(ctx: PeerContext):
    """The engine with no batching on the peers' backend and threads, in this process: one request alone."""
    import torch

    from stepserve import Engine
    from stepserve.engine.loading import load_executor

    h = ctx.handler
    torch.set_num_threads(h.threads)
    return Engine(load_executor(h.model, h.device, h.dtype, h.backend, h.threads), strategy="none")


async def idle_overhead(setting: PeerSetting, ctx: PeerContext, bare_engine, spec: RequestSpec, rounds: int) -> dict:
    """Alternate: the bare pipeline in process, then the same request through the peer; medians and their gap."""
    target = PeerTarget(setting, ctx)
    await target.start()
    bare, served = [], []
    try:
        for i in range(rounds + 1):
            spec.seed = i
            t0 = time.perf_counter()
            result = bare_engine.generate([spec.to_params()])[0]
            t1 = time.perf_counter()
            reply = await target.send(spec)
            t2 = time.perf_counter()
            if not result.ok or reply.status != OK:
                raise RuntimeError(f"{setting.name}: idle request failed: {result.error or reply.error}")
            if i > 0:  # the first round warms up
                bare.append(t1 - t0)
                served.append(t2 - t1)
    finally:
        await target.stop()
    b, s = statistics.median(bare), statistics.median(served)
    return {"contender": setting.name, "bare_ms": b * 1e3, "served_ms": s * 1e3, "overhead_ms": (s - b) * 1e3,
            "rounds": rounds}


def knees(args, backend: str, best: list[str]) -> dict[str, float | None]:
    """A rate sweep (a fixed grid of fractions of capacity) over stepserve serve and the given peer settings."""
    peers = ",".join(_spec(name) for name in best)
    out = args.out / "knee"
    stepserve("bench", "--peers", peers, "--model", args.model, "--backend", backend, "--steps", args.steps,
              "--rate-frac", str(args.rate_frac), "--duration", str(args.sweep_duration), "--warmup", str(args.warmup),
              "--seed", str(args.seed), "--threads", str(args.threads), "--max-batch-size", str(args.max_batch_size),
              "--sweep", "--sweep-fracs", args.knee_fracs, "--sweep-duration", str(args.sweep_duration),
              "--out", str(out), "--no-progress")
    results = json.loads((out / "results.json").read_text())
    capacity = results["capacity"]["rps"]
    found = {}
    for k in results["knees"]:
        found[k["contender"]] = k["rate_rps"]
        rate = "below the lowest rate tried" if k["rate_rps"] is None else (
            f"{k['rate_rps']:.2f} req/s ({k['rate_rps'] / capacity:.2f}x capacity)")
        print(f"knee {k['contender']:24} {rate}" + (" (held at the highest rate tried)" if k["held_at_top"] else ""))
    return found


def _spec(name: str) -> str:
    """'ray(b8,10ms)' -> 'ray@8x10' (the --peers form of a contender's name)."""
    peer, _, rest = name.partition("(b")
    batch, _, wait = rest.rstrip(")").partition(",")
    return f"{peer}@{batch}x{wait.removesuffix('ms')}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p, "bench-out/peers")
    p.add_argument("--peers", default="triton,ray,litserve")
    p.add_argument("--rate-frac", type=float, default=0.7)
    p.add_argument("--repeats", type=int, default=1, help="replays of the trace comparison (order rotated)")
    p.add_argument("--idle-setting", default="8x10", help="BATCHxWAIT_MS of each peer in the idle measurement")
    p.add_argument("--idle-steps", type=int, default=20)
    p.add_argument("--idle-rounds", type=int, default=15)
    p.add_argument("--skip-trace", action="store_true", help="only the idle overhead")
    p.add_argument("--knee-fracs", help="then sweep these fractions of capacity for stepserve and each peer's best "
                                        "setting (every point restarts every server: slow), e.g. 0.05,0.1,0.2,0.4")
    p.add_argument("--sweep-duration", type=float, default=15.0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    settings = parse_peers(args.peers)
    backend = "onnxruntime" if any(s.peer == "triton" for s in settings) else "torch"
    summary: dict = {"backend": backend, "threads": args.threads}

    if not args.skip_trace:
        trace_out = args.out / "trace"
        stepserve("bench", "--peers", args.peers, "--model", args.model, "--backend", backend, "--steps", args.steps,
                  "--rate-frac", str(args.rate_frac), "--duration", str(args.duration), "--warmup", str(args.warmup),
                  "--seed", str(args.seed), "--threads", str(args.threads), "--max-batch-size",
                  str(args.max_batch_size), "--repeats", str(args.repeats), "--out", str(trace_out), "--no-progress")
        results = json.loads((trace_out / "results.json").read_text())
        best = goodput_table(results)
        ours_name, ours = best.pop("stepserve")
        print(f"\nSLO p95 {results['slo_s'] * 1000:.0f} ms; {results['load_description']}")
        for s in results["summaries"]:
            print(f"  {s['contender']:24} goodput {s['goodput_rps']['median']:.2f}/s  throughput "
                  f"{s['throughput_rps']['median']:.2f}/s  p50 {_ms(s['p50_s']['median'])}  "
                  f"p95 {_ms(s['p95_s']['median'])}  completed {s['completed']}/{s['offered']}")
        summary["slo_ms"] = results["slo_s"] * 1000
        summary["goodput"] = {"stepserve": [ours_name, ours], **{k: list(v) for k, v in best.items()}}
        for fam, (name, value) in best.items():
            ratio = f"{ours / value:.2f}x" if value > 0 else "inf (the peer's best met the SLO for no request)"
            print(f"goodput: {ours_name} {ours:.2f}/s = {ratio} {fam}'s best setting {name} ({value:.2f}/s)")

        if args.knee_fracs:
            summary["knees"] = knees(args, backend, [name for name, _ in best.values()])

    batch, _, wait = args.idle_setting.partition("x")
    ctx = PeerContext(HandlerOptions(args.model, backend, "cpu", "float32", args.threads, int(batch)),
                      args.out / "idle")
    spec = RequestSpec(prompt="seven", seed=0, num_inference_steps=args.idle_steps)
    idle_settings = [PeerSetting("stepserve", args.max_batch_size, None, "continuous")]
    idle_settings += [PeerSetting(peer, int(batch), float(wait)) for peer in dict.fromkeys(s.peer for s in settings)]
    summary["idle"] = []
    bare = bare_pipeline(ctx)
    for setting in idle_settings:
        row = asyncio.run(idle_overhead(setting, ctx, bare, spec, args.idle_rounds))
        summary["idle"].append(row)
        print(f"idle {row['contender']:24} {args.idle_steps}-step request: served {row['served_ms']:.1f} ms, bare "
              f"pipeline {row['bare_ms']:.1f} ms, overhead {row['overhead_ms']:.1f} ms (median of {row['rounds']})")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.0f} ms"


if __name__ == "__main__":
    main()
