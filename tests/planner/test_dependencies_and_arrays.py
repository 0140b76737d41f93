"""Dependencies (after*, singleton) and job arrays with a concurrency limit."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_helpers import job, node, reason, running, snap, started

from scheduler.planner import depends_on, parse_array, parse_dependency, plan


@pytest.mark.parametrize("text, normal", [
    ("afterok:12:13,singleton", "afterok:12:13,singleton"),
    ("12", "afterany:12"),
    ("12:13", "afterany:12:13"),
    ("AfterOK:5:5", "afterok:5"),
    ("after:3, afternotok:4", "after:3,afternotok:4"),
    ("singleton,singleton", "singleton"),
])
def test_dependency_text_is_normalised(text, normal):
    assert parse_dependency(text) == normal


@pytest.mark.parametrize("text, words", [
    ("afterwards:12", "unknown type 'afterwards'"),
    ("afterok", "needs at least one job id"),
    ("afterok:x", "'x'"),
    ("singleton:3", "singleton takes no job ids"),
    ("afterok:1?afterok:2", "'?'"),
    ("afterok:1,,", "empty clause"),
])
def test_bad_dependencies_are_refused_with_the_offending_part(text, words):
    with pytest.raises(ValueError, match=words.replace("?", r"\?")):
        parse_dependency(text)


def test_depends_on_lists_the_job_ids_the_daemon_must_report():
    assert depends_on("afterok:12:13,singleton,after:4") == (12, 13, 4)


def test_afterok_waits_then_runs_after_success():
    pending = [job(2, dependency="afterok:1")]
    d = plan(snap([node("n1")], pending), 0.0)
    assert reason(d, 2) == "Dependency"
    d = plan(snap([node("n1")], pending, finished={1: "COMPLETED"}), 0.0)
    assert started(d) == [2]


def test_afterok_on_a_failed_job_is_cancelled_with_a_reason():
    d = plan(snap([node("n1")], [job(2, dependency="afterok:1")], finished={1: "FAILED"}), 0.0)
    assert [(c.job_id, c.reason) for c in d.cancels] == [(2, "DependencyNeverSatisfied")]
    assert "FAILED" in d.cancels[0].detail


def test_afternotok_runs_only_after_a_failure():
    d = plan(snap([node("n1")], [job(2, dependency="afternotok:1")], finished={1: "TIMEOUT"}),
             0.0)
    assert started(d) == [2]
    d = plan(snap([node("n1")], [job(2, dependency="afternotok:1")],
                  finished={1: "COMPLETED"}), 0.0)
    assert d.cancels and d.cancels[0].job_id == 2


def test_afterany_runs_whatever_the_outcome():
    d = plan(snap([node("n1")], [job(2, dependency="afterany:1")], finished={1: "CANCELLED"}),
             0.0)
    assert started(d) == [2]


def test_after_runs_once_the_other_job_has_started():
    pending = [job(2, dependency="after:1")]
    assert reason(plan(snap([node("n1")], pending), 0.0), 2) == "Dependency"
    run = [running(1, {"n1": 1})]
    assert started(plan(snap([node("n1")], pending, run), 0.0)) == [2]


def test_singleton_waits_while_a_same_named_job_of_the_user_runs():
    run = [running(1, {"n1": 1}, name="train", user="alice")]
    pending = [job(2, name="train", user="alice", dependency="singleton"),
               job(3, name="train", user="bob", dependency="singleton")]
    d = plan(snap([node("n1")], pending, run), 0.0)
    assert reason(d, 2) == "Dependency" and started(d) == [3]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(["x", "y"]), st.booleans()),
             min_size=1, max_size=12),
    st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(["x", "y"])), max_size=3),
)
def test_a_singleton_never_runs_beside_a_job_of_the_same_name_and_user(pending_spec, run_spec):
    nodes = [node(f"n{i}") for i in range(4)]
    run = [running(100 + i, {f"n{i}": 1}, user=u, name=n) for i, (u, n) in enumerate(run_spec)]
    pending = [job(i + 1, user=u, name=n, dependency="singleton" if s else "")
               for i, (u, n, s) in enumerate(pending_spec)]
    d = plan(snap(nodes, pending, run), 0.0)
    by_id = {j.id: j for j in pending}
    singles = [(by_id[s.job_id].user, by_id[s.job_id].name) for s in d.starts
               if by_id[s.job_id].dependency == "singleton"]
    assert len(singles) == len(set(singles))  # never two singletons of one name and user
    for key in singles:  # and none beside a job of that name and user that was already running
        assert key not in [(r.user, r.name) for r in run]


@pytest.mark.parametrize("spec, indices, limit", [
    ("0-99%10", tuple(range(100)), 10),
    ("1,3,5-7", (1, 3, 5, 6, 7), None),
    ("0-10:5", (0, 5, 10), None),
    ("4", (4,), None),
    ("3,1,1", (1, 3), None),
])
def test_array_specs_parse(spec, indices, limit):
    assert parse_array(spec) == (indices, limit)


@pytest.mark.parametrize("spec, words", [
    ("", "empty"), ("5-1", "ends before it starts"), ("0-9%0", "concurrency limit"),
    ("a-b", "cannot read 'a-b'"), ("0-9:0", "step"), ("0-99999999", "maximum"),
    ("0-20000", "more than 10000 tasks"),
])
def test_bad_array_specs_are_refused_clearly(spec, words):
    with pytest.raises(ValueError, match=words):
        parse_array(spec)


def test_array_task_limit_holds_back_extra_tasks():
    pending = [job(i, array_parent=1, array_limit=2) for i in range(1, 6)]
    d = plan(snap([node("n1")], pending), 0.0)
    assert started(d) == [1, 2]
    assert {reason(d, i) for i in (3, 4, 5)} == {"JobArrayTaskLimit"}


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(0, 8), st.integers(1, 15), st.integers(1, 16))
def test_an_arrays_concurrency_limit_holds(limit, already, tasks, free_gpus):
    already = min(already, limit)
    nodes = [node("n1", gpus=16, free=16), node("n2", gpus=16, free=free_gpus)]
    run = [running(100 + i, [("n1", (i,))], array_parent=100, array_limit=limit)
           for i in range(already)]
    pending = [job(101 + already + i, array_parent=100, array_limit=limit) for i in range(tasks)]
    d = plan(snap(nodes, pending, run), 0.0)
    assert already + len(d.starts) <= limit
    assert len(d.starts) == min(limit - already, tasks)  # and it does not hold back more
