"""Run-time prediction from history: back-off to coarser keys, explanations, online learning."""

import pytest

from scheduler.planner import JobView
from scheduler.predict import JobFeatures, Predictor


def alice(name="train", gpus=1):
    return JobFeatures("alice", name, "gpu", gpus)


def test_nothing_is_predicted_before_any_job_ended():
    assert Predictor().predict(alice()) is None


def test_the_users_runs_of_the_same_name_answer_first():
    p = Predictor(min_samples=2)
    for runtime in (100.0, 120.0, 110.0):
        p.observe(alice("train"), runtime)
    for runtime in (5000.0, 6000.0):
        p.observe(alice("eval"), runtime)
    guess = p.predict(alice("train"))
    assert guess.seconds == 110.0 and guess.samples == 3 and guess.confident
    assert guess.basis == "user alice's jobs named 'train'"
    assert "3 past runs of user alice's jobs named 'train'" in guess.explain()


def test_a_user_without_history_falls_back_to_the_queue_and_says_so():
    p = Predictor(min_samples=2)
    for runtime in (300.0, 400.0, 500.0):
        p.observe(JobFeatures("bob", "x", "gpu", 4), runtime)
    guess = p.predict(JobFeatures("carol", "y", "gpu", 4))
    assert guess.seconds == 400.0 and guess.basis == "4-GPU jobs in gpu"
    assert "too little history for user carol's jobs named 'y' (0), user carol's jobs (0)" \
        in guess.explain()


def test_only_all_jobs_to_go_on_is_not_confident():
    p = Predictor(min_samples=3)
    p.observe(alice(), 50.0)
    guess = p.predict(JobFeatures("dan", "", "cpu", 2))
    assert guess.basis == "all jobs" and not guess.confident and guess.seconds == 50.0


def test_recent_runs_outweigh_old_ones():
    p = Predictor(window=4, min_samples=1)
    for runtime in [10.0] * 10 + [1000.0] * 4:
        p.observe(alice(), runtime)
    assert p.predict(alice()).seconds == 1000.0


def test_features_of_a_job_view_use_its_account_and_gang_size():
    f = JobFeatures.of(JobView(1, "ann", "batch", name="sweep", gpus=4, nodes=2, account="nlp"))
    assert f == JobFeatures("ann", "sweep", "nlp", 8)


@pytest.mark.parametrize("kw", [{"quantile": 1.0}, {"window": 0}, {"min_samples": 9, "window": 4}])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        Predictor(**kw)


def test_a_negative_run_time_is_refused():
    with pytest.raises(ValueError, match="runtime_s"):
        Predictor().observe(alice(), -1.0)
