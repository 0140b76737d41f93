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
