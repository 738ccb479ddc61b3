"""`stepserve simulate --replicas N --router R [--autoscale MIN:MAX]`: every contender runs as a fleet, results
carry what the fleet did (replica-seconds, replicas over time, lost replicas with the requests they failed),
replica_load.png shows each replica's work over time, and bad fleet flags get one line naming what is allowed."""

import json

import pytest

from stepserve.commands.simulate import main
from stepserve.costs import CostModel, LatencyModel

WORKLOAD = ["--steps", "2,6", "--duration", "6", "--warmup", "1", "--drain", "2", "--capacity-duration", "2",
            "--no-progress", "--seed", "3", "--strategies", "slo", "--rate-frac", "0.7"]


@pytest.fixture
def latency_file(tmp_path):
    path = tmp_path / "latency.json"
    LatencyModel.from_cost_model(CostModel()).save(path)
    return path


def test_a_fleet_run_writes_what_the_fleet_did(tmp_path, latency_file):
    out = tmp_path / "fleet"
    workload = [*WORKLOAD, "--steps", "20,40", "--rate-frac", "0.9"]  # every replica busy when one is lost
    assert main(["--latency-model", str(latency_file), *workload, "--replicas", "3", "--router", "power_of_two",
                 "--fail-replica", "2@3.0", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    run = data["runs"][0]
    fleet = run["fleet"]
    assert fleet["replicas"] == 3 and fleet["router"] == "power_of_two" and fleet["lost_replicas"] == [2]
    assert fleet["failed_on_lost"] >= 1 and run["counts"]["failed"] >= fleet["failed_on_lost"]  # counted, not dropped
    assert fleet["replica_s"] > 0 and len(fleet["load_work_s"]) == 3 and len(fleet["load_t_s"]) > 10
    assert (out / "replica_load.png").stat().st_size > 1000
    report = (out / "report.md").read_text()
    assert "## Fleet (simulated replicas)" in report and "| slo | 3 | power_of_two |" in report


def test_an_autoscaled_fleet_reports_its_replicas_over_time(tmp_path, latency_file):
    out = tmp_path / "auto"
    assert main(["--latency-model", str(latency_file), *WORKLOAD, "--autoscale", "1:4", "--startup-s", "0.5",
                 "--slo-p95-ms", "300", "--out", str(out)]) == 0
    fleet = json.loads((out / "results.json").read_text())["runs"][0]["fleet"]
    assert fleet["autoscale"].startswith("1:4 slo") and fleet["replicas_over_time"][0] == [0.0, 1]
    assert max(n for _, n in fleet["replicas_over_time"]) > 1  # 0.7 of the capacity of one: it had to grow


def test_the_utilisation_flag_reaches_the_slo_policy(latency_file):
    from stepserve.commands.simulate_fleet import split_fleet
    from stepserve.sim.fleet_run import build_fleet

    rest, settings = split_fleet(["--autoscale", "1:4", "--autoscale-utilisation", "0.3", "--steps", "2,6"])
    assert rest == ["--steps", "2,6"] and settings.utilisation == 0.3
    _, fleet, _ = build_fleet(settings, LatencyModel.load(latency_file), lambda r: None, 1.0, 0, 10.0)
    assert fleet.autoscaler.policy.utilisation == 0.3


@pytest.mark.parametrize("bad, says", [
    (["--replicas", "0"], "--replicas: must be >= 1"),
    (["--router", "random"], "allowed: least_work, least_work_sampled, power_of_two"),
    (["--autoscale", "3:1"], "1 <= MIN <= MAX"),
    (["--autoscale", "1:2", "--autoscale-policy", "k8s"], "allowed: slo, ray"),
    (["--startup-s", "5"], "add --autoscale MIN:MAX"),
    (["--autoscale-utilisation", "0.5"], "add --autoscale MIN:MAX"),
    (["--autoscale", "1:2", "--autoscale-utilisation", "1.5"], "a fraction in (0, 1], got 1.5"),
    (["--autoscale", "1:2", "--autoscale-policy", "ray", "--autoscale-utilisation", "0.5"], "steers the slo policy"),
    (["--replicas", "2", "--fail-replica", "5@1"], "no such replica"),
    (["--replicas", "2", "--fail-replica", "x"], "expected R@T"),
])
def test_bad_fleet_flags_exit_2_with_one_line(tmp_path, latency_file, capsys, bad, says):
    assert main(["--latency-model", str(latency_file), *WORKLOAD, *bad, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stepserve simulate:") and "\n" not in err and says in err


def test_a_replica_holds_the_devices_of_its_latency_models_degree(tmp_path, latency_file):
    """A model profiled at --ulysses-degree 2: each replica is two devices, stepping with that model's curve."""
    from stepserve.costs.degree import at_degree, parallel_entry

    split = tmp_path / "ulysses2.json"
    at_degree(LatencyModel.load(latency_file), 0.6, parallel_entry(ulysses=2)).save(split)
    out = tmp_path / "split"
    assert main(["--latency-model", str(split), *WORKLOAD, "--replicas", "2", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    fleet = data["runs"][0]["fleet"]
    assert fleet["devices_per_replica"] == 2 and fleet["device_s"] == pytest.approx(2 * fleet["replica_s"], abs=1e-3)
    assert "2 replicas of 2 devices each" in json.dumps(data)
