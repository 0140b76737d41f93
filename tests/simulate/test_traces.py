"""Trace files: Philly, Helios-style and generic CSVs; bad rows counted by reason, bad files by line."""

import pytest

from scheduler.traces import TraceError, parse_window, read_trace

HELIOS = """job_id,user,vc,gpu_num,cpu_num,node_num,state,submit_time,start_time,end_time,duration,queue
j1,u1,vcA,8,48,1,COMPLETED,2020-09-01 00:00:10,2020-09-01 00:00:12,2020-09-01 01:00:12,3600,0
j2,u2,vcA,16,96,2,FAILED,2020-09-01 00:00:05,2020-09-01 00:00:06,2020-09-01 00:10:06,600,1
j3,u1,vcB,0,4,1,COMPLETED,2020-09-01 00:01:00,2020-09-01 00:01:00,2020-09-01 00:02:00,60,0
j4,u3,vcB,1,4,1,CANCELLED,2020-09-01 00:02:00,,,-5,0
j5,u3,vcB,abc,4,1,COMPLETED,2020-09-01 00:03:00,,,60,0
j6,u3,vcB,2,4,1,RUNNING,2020-09-01 00:04:00,,,60,0
j7,u3,vcB,2,4,1,COMPLETED,,,,60,0
"""


def write(tmp_path, text, name="t.csv"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_a_helios_log_becomes_gpu_jobs_with_users_vcs_and_gangs(tmp_path):
    t = read_trace(write(tmp_path, HELIOS))
    assert t.format == "helios"
    assert [(j.user, j.vc, j.gpus, j.nodes, j.duration, j.submit) for j in t.jobs] == [
        ("u2", "vcA", 16, 2, 600.0, 0.0), ("u1", "vcA", 8, 1, 3600.0, 5.0)]


def test_rows_that_cannot_be_jobs_are_counted_by_reason(tmp_path):
    t = read_trace(write(tmp_path, HELIOS))
    assert dict(t.skipped) == {"no GPUs": 1, "negative duration": 1, "malformed gpu_num": 1,
                               "never ended": 1, "missing submit_time": 1}


def test_a_row_with_the_wrong_number_of_fields_fails_with_its_line(tmp_path):
    text = "submit_time,duration,gpus\n0,10,1\n5,10\n"
    with pytest.raises(TraceError, match=r"t\.csv, line 3: 2 fields, the header has 3"):
        read_trace(write(tmp_path, text))


def test_unknown_columns_fail_and_say_what_is_expected(tmp_path):
    with pytest.raises(TraceError, match="line 1: unknown trace columns"):
        read_trace(write(tmp_path, "when,how_long\n1,2\n"))


def test_a_window_keeps_jobs_submitted_inside_it_and_measures_from_its_start(tmp_path):
    text = ("timestamp,duration,num_gpus,gpu_time,cluster\n"
            "2017-09-30 23:59:59,10,1,10,a\n2017-10-01 00:00:30,10,1,10,a\n"
            "2017-10-02 23:59:59,10,1,10,a\n2017-10-03 00:00:00,10,1,10,a\n")
    t = read_trace(write(tmp_path, text), parse_window("2017-10-01", "2017-10-02"))
    assert [j.submit for j in t.jobs] == [30.0, 2 * 86400 - 1.0]
    assert t.span_s == 2 * 86400 and t.skipped["outside the window"] == 2


def test_a_window_that_ends_before_it_starts_is_refused():
    with pytest.raises(ValueError, match="not after its start"):
        parse_window("2017-10-02 00:00:00", "2017-10-01 00:00:00")


def test_a_demo_slice_compresses_the_busiest_stretch_into_the_demo():
    from scheduler.traces import TraceJob
    from scheduler.traces.demo import demo_jobs

    trace = [TraceJob(1, 0.0, 50.0, 1)] + \
        [TraceJob(i, 100000.0 + i * 60, 3600.0 * i, 16) for i in range(2, 12)]
    jobs = demo_jobs(trace, seconds=60, speedup=600, seed=1)
    assert len(jobs) == 10 and jobs[0].at_s == 0.0 and jobs[-1].at_s == pytest.approx(0.9)
    assert all(j.gpus == 8 and 1.0 <= j.runtime_s <= 60 for j in jobs)
    assert jobs == demo_jobs(trace, seconds=60, speedup=600, seed=1)


# Alibaba's cluster-trace-gpu-v2023 pod list, as its files are laid out (seconds from the start)
ALIBABA = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
openb-pod-0000,12000,16384,1,1000,,LS,Running,0,9000,0
openb-pod-0001,6000,12288,1,460,,BE,Failed,100,700,160
openb-pod-0002,88000,327680,8,1000,,Burstable,Succeeded,50,4050,60
openb-pod-0003,4000,8192,0,0,,BE,Succeeded,70,900,70
openb-pod-0004,4000,8192,2,1000,V100M16|V100M32,LS,Pending,80,5000,
openb-pod-0005,4000,8192,1,1000,,LS,Running,90,9000,95
openb-pod-0006,4000,8192,1,1000,,BE,Failed,200,150,210
openb-pod-0007,4000,8192,1,1000,,BE,Succeeded,300,250,280
openb-pod-0008,4000,8192,4,1000,,LS,Running,400,8999,400
"""


def test_alibaba_pods_run_from_scheduling_to_deletion_queued_by_qos(tmp_path):
    t = read_trace(write(tmp_path, ALIBABA))
    assert t.format == "alibaba"
    # submitted when created; ran from scheduled to deleted; a fractional GPU is a whole one
    assert [(j.submit, j.duration, j.gpus, j.vc) for j in t.jobs] == [
        (0.0, 3990.0, 8, "Burstable"), (50.0, 540.0, 1, "BE"), (350.0, 8599.0, 4, "LS")]
    assert t.adjusted == {"GPU-sharing pod given a whole GPU": 1}


def test_alibaba_rows_that_never_ran_or_ran_past_the_trace_are_counted(tmp_path):
    t = read_trace(write(tmp_path, ALIBABA))
    # pods 0 and 5 were still Running at the last deletion (9000 s): their run time is unknown
    assert dict(t.skipped) == {"no GPUs": 1, "never scheduled": 1, "negative duration": 1,
                               "scheduled before created": 1,
                               "still running at the trace's end": 2}


def test_simulate_reads_an_alibaba_trace_and_reports_what_it_changed(tmp_path):
    from click.testing import CliRunner

    from scheduler.simulate import simulate

    path = write(tmp_path, ALIBABA)
    r = CliRunner().invoke(simulate, ["--trace", str(path), "--cluster", "1x8", "--policy",
                                      "fifo,oracle", "--quiet"])
    assert r.exit_code == 0, r.output
    assert "never scheduled (1)" in r.output
    assert "rows read with a change: GPU-sharing pod given a whole GPU (1)" in r.output
    r = CliRunner().invoke(simulate, ["--trace", str(path), "--cluster", "1x8", "--json",
                                      "--quiet"])
    out = __import__("json").loads(r.output)
    assert out["jobs"] == 3 and out["adjusted_rows"] == {"GPU-sharing pod given a whole GPU": 1}
