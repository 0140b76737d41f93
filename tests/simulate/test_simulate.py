"""`trainyard simulate`: trace replay through the planner, with metrics an operator can check."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from scheduler.planner import PolicyConfig
from scheduler.simulate import gang_shape, load_trace, parse_cluster, simulate, simulate_policy

PHILLY = Path("/work/shared/data/traces/philly")
if not PHILLY.exists():
    PHILLY = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces" / "philly"


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def run_cli(*args):
    result = CliRunner().invoke(simulate, [*args, "--quiet"], catch_exceptions=False)
    return result


def sim_json(*args):
    r = run_cli(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


GENERIC = "submit_time,duration,gpus\n0,100,1\n0,100,1\n"


def test_two_jobs_on_one_gpu_give_exact_metrics(tmp_path):
    m = sim_json("--trace", write(tmp_path, "t.csv", GENERIC), "--cluster", "1x1",
                 "--policy", "fifo")
    assert m["jobs"] == 2
    assert (m["avg_jct_s"], m["p50_jct_s"], m["p99_jct_s"]) == (150.0, 100.0, 200.0)
    assert (m["avg_wait_s"], m["p99_wait_s"]) == (50.0, 100.0)
    assert m["makespan_s"] == 200.0 and m["utilization"] == 1.0


def test_json_has_the_documented_keys(tmp_path):
    m = sim_json("--trace", write(tmp_path, "t.csv", GENERIC), "--cluster", "2x4")
    for key in ("jobs", "avg_jct_s", "p50_jct_s", "p99_jct_s", "avg_wait_s", "p99_wait_s",
                "utilization", "makespan_s"):
        assert key in m


# a big job waits for a long one; short jobs could fill the hole in the meantime
HOLE = """submit_time,duration,gpus
0,1000,4
1,100,8
2,50,2
3,50,2
"""


def test_backfill_fills_holes_that_fifo_leaves_idle(tmp_path):
    trace = write(tmp_path, "t.csv", HOLE)
    fifo = sim_json("--trace", trace, "--cluster", "1x8", "--policy", "fifo")
    bf = sim_json("--trace", trace, "--cluster", "1x8", "--policy", "backfill")
    assert bf["avg_jct_s"] < fifo["avg_jct_s"]
    # and the big job is not delayed: it starts the moment the long one ends (t=1000)
    assert bf["makespan_s"] == 1100.0


def test_las_lets_a_short_job_overtake_a_long_one_by_preemption(tmp_path):
    trace = write(tmp_path, "t.csv", "submit_time,duration,gpus\n0,100000,8\n50000,600,8\n")
    fifo = sim_json("--trace", trace, "--cluster", "1x8", "--policy", "fifo")
    las = sim_json("--trace", trace, "--cluster", "1x8", "--policy", "las")
    assert las["preemptions"] == 1 and fifo["preemptions"] == 0
    assert las["avg_jct_s"] < fifo["avg_jct_s"]
    assert las["jobs"] == 2  # the preempted job came back and finished


@pytest.mark.parametrize("toml", [
    # keys whose trainyard.toml name differs from the planner's field, as an operator writes them
    "[scheduler]\nlas_thresholds_gpu_hours = [200, 400]\n",
    "[scheduler]\nlas_preempt_once_per_level = true\nlas_thresholds_gpu_hours = [1000]\n",
])
def test_a_config_file_changes_the_replayed_policy(tmp_path, toml):
    # a short job arrives while a long one runs: LAS preempts it by default (it has passed the
    # first threshold, 1 GPU-hour; it has 111), not when the thresholds are past what it has
    trace = write(tmp_path, "t.csv", "submit_time,duration,gpus\n0,100000,8\n50000,600,8\n")
    plain = sim_json("--trace", trace, "--cluster", "1x8", "--policy", "las")
    tuned = sim_json("--trace", trace, "--cluster", "1x8", "--policy", "las",
                     "--config", write(tmp_path, "trainyard.toml", toml))
    assert plain["preemptions"] == 1
    assert tuned["preemptions"] == 0 and tuned["jobs"] == 2


def test_a_config_file_with_a_grace_period_sets_the_checkpoint_time(tmp_path):
    trace = write(tmp_path, "t.csv", "submit_time,duration,gpus\n0,100000,8\n50000,600,8\n")
    runs = {g: sim_json("--trace", trace, "--cluster", "1x8", "--policy", "las", "--config",
                        write(tmp_path, f"g{g}.toml", f"[scheduler]\ngrace_period = {g}\n"))
            for g in (10, 500)}
    # the preempted job's grace period is lost time: 490 s more of it, on one of two jobs
    assert runs[500]["makespan_s"] - runs[10]["makespan_s"] == 490.0


def test_jobs_larger_than_their_vc_are_counted_not_silently_dropped(tmp_path):
    trace = write(tmp_path, "p.csv", "timestamp,duration,num_gpus,gpu_time,cluster\n"
                  "2017-10-01 00:00:00,60.0,16,960.0,aaa\n"
                  "2017-10-01 00:00:05,60.0,8,480.0,aaa\n"
                  "2017-10-01 00:00:09,60.0,1,60.0,zzz\n")
    vcs = write(tmp_path, "vc.csv", "vc,node num\naaa,1\n")
    m = sim_json("--trace", trace, "--cluster", vcs, "--policy", "fifo")
    assert (m["jobs"], m["skipped_oversize"], m["skipped_no_queue"]) == (1, 1, {"zzz": 1})
    assert m["jobs_in_trace"] == 3
    text = run_cli("--trace", trace, "--cluster", vcs, "--policy", "fifo").output
    assert "1 jobs larger than their queue's nodes" in text
    assert "zzz (1)" in text


def test_philly_rows_are_replayed_in_submit_order(tmp_path):
    trace = write(tmp_path, "p.csv", "timestamp,duration,num_gpus,gpu_time,cluster\n"
                  "2017-10-09 07:01:55,66.0,1,66.0,a\n"
                  "2017-10-09 06:13:03,2951.0,1,2951.0,a\n"
                  "2017-10-09 06:13:36,2759.0,2,5518.0,b\n\n")
    jobs = load_trace(trace)
    assert [j.duration for j in jobs] == [2951.0, 2759.0, 66.0]
    assert [j.submit for j in jobs] == [0.0, 33.0, 2932.0]
    assert jobs[1].vc == "b" and jobs[1].gpus == 2


def test_each_vc_gets_its_own_queue_and_nodes(tmp_path):
    c = parse_cluster(write(tmp_path, "vc.csv", "vc,node num\na,2\nb,3\n"))
    assert sorted(c.queues) == ["a", "b"]
    assert c.size("a") == (2, 16) and c.size("b") == (3, 24)
    c = parse_cluster("4x2")
    assert c.size("default") == (4, 8)


@pytest.mark.parametrize("spec", ["4y8", "0x8", "x8", "missing.csv"])
def test_bad_cluster_spec_is_a_usage_error(spec):
    r = CliRunner().invoke(simulate, ["--trace", __file__, "--cluster", spec])
    assert r.exit_code == 2


def test_unknown_policy_is_a_usage_error(tmp_path):
    r = CliRunner().invoke(simulate, ["--trace", write(tmp_path, "t.csv", GENERIC),
                                      "--cluster", "1x1", "--policy", "sjf"])
    assert r.exit_code == 2 and "unknown policy 'sjf'" in r.output


@pytest.mark.parametrize("gpus, shape", [(1, (1, 1)), (8, (8, 1)), (12, (6, 2)), (16, (8, 2)),
                                         (24, (8, 3)), (128, (8, 16))])
def test_multi_node_jobs_become_equal_gangs(gpus, shape):
    assert gang_shape(gpus, 8) == shape


def test_help_explains_spec_and_policies():
    text = CliRunner().invoke(simulate, ["--help"]).output
    for word in ("NxG", "vc,node num", "fifo", "backfill", "fairshare", "las"):
        assert word in text


@pytest.fixture(scope="module")
def philly_slice():
    if not (PHILLY / "philly.csv").exists():
        pytest.skip("the Philly trace is not on this machine")
    return str(PHILLY / "philly.csv"), str(PHILLY / "philly_vc_nodes_helios.csv")


def test_a_philly_slice_replays_with_every_policy_and_every_job_accounted_for(philly_slice):
    trace, vcs = philly_slice
    out = sim_json("--trace", trace, "--cluster", vcs, "--policy", "fifo,backfill,fairshare,las",
                   "--limit", "1500")
    assert sorted(out) == ["backfill", "fairshare", "fifo", "las"]
    for m in out.values():
        skipped = m["skipped_oversize"] + sum(m["skipped_no_queue"].values())
        assert m["jobs"] + skipped == m["jobs_in_trace"] == 1500
        assert 0 < m["utilization"] <= 1


def test_results_are_deterministic_for_a_seed(philly_slice):
    trace, _ = philly_slice
    args = ("--trace", trace, "--cluster", "20x8", "--policy", "fairshare", "--limit", "400")
    a, b = sim_json(*args, "--seed", "7"), sim_json(*args, "--seed", "7")
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b


def test_plot_is_written(tmp_path):
    png = tmp_path / "cdf.png"
    r = run_cli("--trace", write(tmp_path, "t.csv", HOLE), "--cluster", "1x8",
                "--policy", "fifo,backfill", "--plot", str(png))
    assert r.exit_code == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_simulator_and_daemon_share_one_planner():
    from scheduler import planner
    from scheduler import simulate as sim

    assert sim.plan is planner.plan
    policy = PolicyConfig.preset("fifo")
    assert simulate_policy([], parse_cluster("1x1"), policy)["jobs"] == 0
