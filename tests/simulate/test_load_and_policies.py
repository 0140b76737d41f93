"""`trainyard simulate --load/--window`, the oracle and QSSF on small traces."""

import json

import pytest
from click.testing import CliRunner

from scheduler.simulate import simulate

# 10 jobs over 1000 s: 4,000 GPU-seconds of 1-GPU work
EVEN = "submit_time,duration,gpus\n" + "".join(f"{i * 100},400,1\n" for i in range(10)) + \
    "1000,0,1\n"


def write(tmp_path, text, name="t.csv"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def sim(*args):
    r = CliRunner().invoke(simulate, [*args, "--quiet"], catch_exceptions=False)
    return r


def sim_json(*args):
    r = sim(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_load_sizes_one_pool_for_the_offered_load(tmp_path):
    # 4,000 GPU-s over 1,000 s is 4 GPUs busy: at 50% load that is 8 GPUs, one 8-GPU node
    m = sim_json("--trace", write(tmp_path, EVEN), "--load", "0.5", "--policy", "fifo")
    assert m["gpus"] == 8 and m["offered_load"] == pytest.approx(0.5)
    m = sim_json("--trace", write(tmp_path, EVEN), "--load", "0.5", "--gpus-per-node", "2",
                 "--policy", "fifo")
    assert m["gpus"] == 8


def test_load_per_vc_sizes_each_queue_for_its_own_jobs(tmp_path):
    text = ("submit_time,duration,gpus,queue\n0,1000,8,a\n0,1000,1,b\n1000,0,1,a\n")
    out = sim("--trace", write(tmp_path, text), "--load", "1.0", "--cluster", "per-vc",
              "--policy", "fifo")
    assert out.exit_code == 0, out.output
    assert "16 GPUs (2 x 8)" in out.output  # one node each: a needs 8 GPUs, b needs 1


@pytest.mark.parametrize("load", ["0", "-0.5", "1.6", "3"])
def test_load_outside_0_to_1_5_is_refused(tmp_path, load):
    r = CliRunner().invoke(simulate, ["--trace", write(tmp_path, EVEN), "--load", load])
    assert r.exit_code == 2 and "must be in (0, 1.5]" in r.output


def test_a_cluster_or_a_load_is_needed(tmp_path):
    r = CliRunner().invoke(simulate, ["--trace", write(tmp_path, EVEN)])
    assert r.exit_code == 2 and "--load" in r.output


def test_window_replays_only_the_jobs_submitted_in_it(tmp_path):
    m = sim_json("--trace", write(tmp_path, EVEN), "--window", "200", "700", "--cluster", "1x8",
                 "--policy", "fifo")
    assert m["jobs"] == 5 and m["skipped_rows"] == {"outside the window": 6}


def test_bad_rows_are_reported_not_fatal(tmp_path):
    text = "submit_time,duration,gpus\n0,100,1\n5,-1,1\n6,x,1\n"
    out = sim("--trace", write(tmp_path, text), "--cluster", "1x1", "--policy", "fifo")
    assert out.exit_code == 0
    assert "rows not read as jobs: malformed duration (1), negative duration (1)" in out.output


def test_a_cut_file_fails_with_its_line_number(tmp_path):
    r = CliRunner().invoke(simulate, ["--trace", write(tmp_path, "submit_time,duration,gpus\n"
                                                                  "0,100,1\n1,2\n"),
                                      "--cluster", "1x1"])
    assert r.exit_code == 2 and "line 3" in r.output


# one long job, then many short ones that queue behind it on one GPU
CONVOY = "submit_time,duration,gpus\n0,20000,1\n" + \
    "".join(f"{10 + i},100,1\n" for i in range(30))


def test_every_policy_reports_jct_and_preemptions_and_the_oracle_ratio(tmp_path):
    out = sim_json("--trace", write(tmp_path, CONVOY), "--cluster", "1x1",
                   "--policy", "fifo,backfill,fairshare,las,qssf,oracle")
    for m in out.values():
        assert {"avg_jct_s", "p99_jct_s", "preemptions", "avg_jct_vs_oracle"} <= set(m)
        assert m["jobs"] == 31
    # the oracle preempts the long job once and runs every short one first
    assert out["oracle"]["preemptions"] == 1
    assert out["oracle"]["avg_jct_vs_oracle"] == 1.0
    assert min(m["avg_jct_s"] for m in out.values()) == out["oracle"]["avg_jct_s"]
    assert out["fifo"]["avg_jct_vs_oracle"] > 5


def test_qssf_learns_run_times_as_jobs_end_and_reports_its_accuracy(tmp_path):
    # ten jobs alone on the cluster teach it; then a burst of both kinds queues up
    times = [i * 6000 for i in range(10)] + [60000 + i for i in range(30)]
    text = "submit_time,duration,gpus,user,name\n" + \
        "".join(f"{t},{100 if i % 2 else 5000},1,ann,{'short' if i % 2 else 'long'}\n"
                for i, t in enumerate(times))
    m = sim_json("--trace", write(tmp_path, text), "--cluster", "1x1", "--policy", "qssf")
    assert m["predictions"] == 39  # the first job ran before anything had ended
    assert m["prediction_within_2x"] > 0.8
    fifo = sim_json("--trace", write(tmp_path, text), "--cluster", "1x1", "--policy", "fifo")
    assert m["avg_jct_s"] < fifo["avg_jct_s"]


def test_las_budget_preempts_a_long_job_once_per_level_it_reaches(tmp_path):
    # a 1-GPU job of 12 GPU-hours, then a 100 s job every 1,000 s; levels of las-budget double
    # from its first threshold, so the long job reaches two of them while the short ones arrive
    from scheduler.planner import PolicyConfig

    first = PolicyConfig.preset("las-budget").las_thresholds_gpu_s[0]
    long_s = 3 * first
    arrivals = range(int(first) + 600, int(long_s), 1000)
    text = f"submit_time,duration,gpus\n0,{long_s},1\n" + \
        "".join(f"{t},100,1\n" for t in arrivals)
    out = sim_json("--trace", write(tmp_path, text), "--cluster", "1x1",
                   "--policy", "las,las-budget")
    assert out["las-budget"]["preemptions"] == 2  # past the first level, then the second
    assert out["las"]["preemptions"] > 10  # LAS evicts it for every short job
    assert out["las-budget"]["jobs"] == out["las"]["jobs"] == len(arrivals) + 1
