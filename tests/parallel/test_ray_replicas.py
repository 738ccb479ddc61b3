"""A Ray Serve replica at a parallel degree owns its ranks' devices: --replica-gpus (CUDA) and --replica-cpus
follow the degree, so R replicas of degree N reserve R x N, and the degree reaches each replica's engine."""

from __future__ import annotations

import pytest
from rank_servers import free_port

from stepserve.commands.flags import degrees_from_args
from stepserve.commands.serve import build_parser, main, serve_settings
from stepserve.parallel.degrees import Degrees
from stepserve.server.ray.options import deployment_options, plan_replicas, replica_settings
from stepserve.server.startup import StartupError


def plan_of(*flags: str, cores: int = 64):
    args = build_parser().parse_args(list(flags))
    return plan_replicas(args, local_cores=cores, degrees=degrees_from_args(args))


@pytest.mark.parametrize("flags, cpus, gpus", [
    (["--replicas", "2", "--ulysses-degree", "2"], 2, 0),  # a CPU per rank's process
    (["--replicas", "2", "--cfg-parallel", "--ulysses-degree", "2"], 4, 0),
    (["--replicas", "3", "--device", "cuda", "--ulysses-degree", "2"], 2, 2),  # a GPU per rank
    (["--replicas", "2", "--device", "cuda", "--tensor-parallel-size", "4"], 4, 4),
    (["--replicas", "2", "--device", "cuda", "--cfg-parallel", "--replica-gpus", "2", "--replica-cpus", "8"], 8, 2),
    (["--replicas", "2"], 1, 0),  # one device: as before
    (["--replicas", "2", "--device", "cuda", "--replica-gpus", "0.5"], 1, 0.5),
])
def test_each_replica_reserves_its_ranks_devices(flags, cpus, gpus):
    plan = plan_of(*flags)
    actor = deployment_options(plan)["ray_actor_options"]
    assert (actor["num_cpus"], actor["num_gpus"]) == (cpus, gpus)


def test_r_replicas_of_degree_n_say_they_use_r_x_n_devices_and_run_one_thread_per_rank():
    plan = plan_of("--replicas", "2", "--device", "cuda", "--ulysses-degree", "4")
    assert "each replica runs --ulysses-degree 4: 4 ranks, one GPU each; 2 x 4 = 8 GPUs in all" in plan.notes
    plan = plan_of("--replicas", "2", "--ulysses-degree", "2", "--replica-cpus", "4", "--threads", "8")
    assert plan.threads == 2  # 4 CPUs over 2 ranks


@pytest.mark.parametrize("flags, says", [
    (["--replicas", "2", "--device", "cuda", "--ulysses-degree", "2", "--replica-gpus", "1"],
     "--replica-gpus 1: a replica at --ulysses-degree 2 runs 2 ranks, one GPU each; give 2"),
    (["--replicas", "2", "--ulysses-degree", "2", "--replica-cpus", "1"],
     "--replica-cpus 1: a replica at --ulysses-degree 2 runs 2 rank processes, one CPU each; give at least 2"),
])
def test_devices_that_do_not_follow_the_degree_are_one_line(flags, says):
    with pytest.raises(StartupError) as caught:
        plan_of(*flags)
    assert str(caught.value).startswith(says), caught.value


def test_replicas_of_degree_n_must_fit_the_local_cores(capsys, monkeypatch):
    import stepserve.commands.serve as serve

    monkeypatch.setattr(serve, "available_cores", lambda: 2)
    assert main(["--replicas", "2", "--ulysses-degree", "2", "--port", free_port(), "--threads", "1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("stepserve serve: error: 2 replicas at 2 CPUs each: 4 CPUs in all, but this machine "
                           "has 2; lower the replica count or the degrees"), line


def test_the_degree_reaches_each_replicas_engine():
    flags = ["--replicas", "2", "--ulysses-degree", "2", "--no-memory-cap"]
    args = build_parser().parse_args(flags)
    plan = plan_replicas(args, local_cores=64, degrees=degrees_from_args(args))
    assert replica_settings(serve_settings(args), plan).engine.degrees == Degrees(ulysses=2)


@pytest.mark.slow  # a local Ray cluster, a replica of two ranks
def test_one_replica_at_degree_2_serves_and_stops_without_leftovers(tmp_path_factory):
    import sys
    import uuid
    from pathlib import Path

    import httpx
    from rank_servers import tiny_flux

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
    from ray_cluster import ServeProcess, assert_all_gone, marked_pids

    mark = uuid.uuid4().hex
    server = ServeProcess(mark, "--replicas", "1", "--ulysses-degree", "2", model=str(tiny_flux(tmp_path_factory)))
    try:
        server.wait_ready()
        r = httpx.post(server.url + "/v1/images/generations", json={"prompt": "a cat", "size": "32x32",
                                                                    "num_inference_steps": 2}, timeout=120)
        assert r.status_code == 200 and r.headers["X-Stepserve-Replica"], r.text
        ranks = [pid for pid in marked_pids(mark)
                 if b"stepserve.engine.rank_worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(ranks) == 1, server.tail()  # the replica's second rank
        assert server.stop() == 0, server.tail()
        assert_all_gone(mark)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_replicas_on_a_cluster_elsewhere_are_not_checked_against_this_machines_gpus():
    """The replicas' GPUs are the cluster's: a driver without any still starts replicas at a degree on CUDA (this
    machine has no CUDA device), and the checks that need no device still refuse here."""
    flags = ["--replicas", "2", "--device", "cuda", "--ray-address", "127.0.0.1:1", "--no-memory-cap"]
    settings = serve_settings(build_parser().parse_args([*flags, "--ulysses-degree", "2"]))
    assert settings.engine.degrees == Degrees(ulysses=2)
    with pytest.raises(StartupError, match="--ulysses-degree 2 with --compile is not served"):
        serve_settings(build_parser().parse_args([*flags, "--ulysses-degree", "2", "--compile"]))
