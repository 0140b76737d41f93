"""The daemon schedules with the policy from its config file, through the API, on real sshd nodes."""

import time

import pytest

from tests.conftest import add_sshd_node, wait_for, wait_job

POLICY = """
[scheduler]
policy = "backfill"
grace_period = 1

[queues.low]
priority = 1

[queues.high]
priority = 10
preempts = ["low"]

[teams.vision]
nominal_gpus = 4
lending_limit_gpus = 0
users = ["alice"]
"""


@pytest.fixture
def policy_cluster(daemon_factory, sshd_factory):
    d = daemon_factory(extra_config=POLICY)
    for i in (1, 2):
        add_sshd_node(d, sshd_factory(f"n{i}", d.public_key))
    return d


def test_high_queue_preempts_low_and_the_victim_is_requeued(policy_cluster):
    c = policy_cluster.client()
    bob = policy_cluster.client(c.create_token("bob", "user")["token"])
    lows = [bob.submit({"command": ["sleep", "60"], "gpus": 4, "queue": "low"}) for _ in range(2)]
    for j in lows:
        wait_job(c, j["id"], "RUNNING")
    high = bob.submit({"command": ["sleep", "60"], "gpus": 4, "queue": "high"})
    wait_job(c, high["id"], "RUNNING", timeout=20)
    states = {j["id"]: c.job(j["id"]) for j in lows}
    victims = [j for j in states.values() if j["state"] == "PENDING"]
    assert len(victims) == 1 and victims[0]["attempt"] == 1
    assert victims[0]["preemptions"] == 1  # what a preemption budget (las-budget) counts
    assert all(j["preemptions"] == 0 for j in states.values() if j["state"] == "RUNNING")
    history = [e["detail"]["state"] for e in c.events(limit=1000)
               if e["target"] == str(victims[0]["id"]) and e["action"] == "job.state"]
    assert history[-2:] == ["PREEMPTED", "PENDING"]
    assert any(e["action"] == "job.preempt" for e in c.events(limit=1000))


def test_a_victim_learns_its_deadline_and_gets_its_signal_before_sigkill(policy_cluster):
    admin = policy_cluster.client()
    c = policy_cluster.client(admin.create_token("carl", "user")["token"])  # in no team: no quota
    # the victim checkpoints on USR1 (its --signal) and records when SIGKILL will come
    save = ('trap \'echo "checkpoint before $(cat $TRAINYARD_PREEMPT_DEADLINE_FILE)"; exit 0\' USR1; '
            'echo armed; while :; do sleep 0.1; done')
    lows = [c.submit({"command": ["bash", "-c", save], "gpus": 4, "queue": "low", "signal": "USR1@5"})
            for _ in range(2)]
    for j in lows:  # RUNNING once started; the trap is set once it says so
        wait_job(c, j["id"], "RUNNING")
        wait_for(lambda j=j: "armed" in c.log(j["id"], attempt=0)[0], 20, what="the trap set")
    high = c.submit({"command": ["sleep", "30"], "gpus": 4, "queue": "high"})
    wait_job(c, high["id"], "RUNNING", timeout=20)
    victim = next(j for j in lows if c.job(j["id"])["attempt"] == 1)
    signals = [e for e in admin.events(limit=1000)
               if e["action"] == "job.signal" and e["target"] == str(victim["id"])]
    assert signals and signals[-1]["detail"]["sig"] == "USR1"
    deadline = round(signals[-1]["detail"]["deadline"])
    # every process of the job gets the signal (as in Slurm without B:), the shell runs its trap
    said = wait_for(lambda: "checkpoint" in (out := c.log(victim["id"], attempt=0)[0]) and out, 20,
                    what="the trap's line in the victim's log")
    assert said.strip().splitlines()[-1] == f"checkpoint before {deadline}"


def test_team_quota_holds_jobs_back_with_quotalimit(policy_cluster):
    c = policy_cluster.client()  # the admin token belongs to the daemon's user, alice
    first = c.submit({"command": ["sleep", "30"], "gpus": 4})
    wait_job(c, first["id"], "RUNNING")
    second = c.submit({"command": ["sleep", "30"], "gpus": 4})
    waiting = wait_for(lambda: (j := c.job(second["id"]))["reason"] == "AssocGrpGRES" and j, 15,
                       what="AssocGrpGRES")
    assert waiting["state"] == "PENDING"
    vision = next(t for t in c.teams() if t["name"] == "vision")
    assert (vision["nominal_gpus"], vision["gpus_used"], vision["running"], vision["pending"]) == (4, 4, 1, 1)
    assert "vision" in policy_cluster.cli("teams", check=True).stdout


def test_array_concurrency_limit_and_task_ids(policy_cluster):
    c = policy_cluster.client()
    job = c.submit({"command": ["sh", "-c", "echo task=$TRAINYARD_ARRAY_TASK_ID; sleep 1"], "gpus": 1,
                    "array": "0-5%2", "account": "other"})
    tasks = [j for j in c.jobs(all=True) if j["array_job_id"] == job["id"]]
    assert sorted(t["array_task_id"] for t in tasks) == [0, 1, 2, 3, 4, 5]
    most = 0
    while not all(c.job(t["id"])["state"] == "COMPLETED" for t in tasks):
        running = [t for t in tasks if c.job(t["id"])["state"] in ("RUNNING", "CONFIGURING")]
        most = max(most, len(running))
    assert most <= 2
    assert sorted(c.log(t["id"])[0].strip() for t in tasks) == [f"task={i}" for i in range(6)]


def test_unknown_queue_in_config_is_a_usage_error(tmp_path):
    import subprocess

    from tests.conftest import PY, ROOT

    cfg = tmp_path / "bad.toml"
    cfg.write_text("[queues.x]\nprority = 3\n")
    r = subprocess.run([PY, "-m", "scheduler.cli", "daemon", "--config", str(cfg), "--listen", "127.0.0.1:0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=30,
                       env={"HOME": str(tmp_path), "TRAINYARD_HOME": str(tmp_path / "s"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "prority" in r.stderr


COHORT = """
[scheduler]
policy = "backfill"
grace_period = 1

[teams.vision]
nominal_gpus = 4
cohort = "lab"
users = ["alice"]

[teams.speech]
nominal_gpus = 4
cohort = "lab"
users = ["bob"]
"""


def test_a_reclaim_preempts_one_borrower_once_and_the_lender_gets_the_gpus(daemon_factory, sshd_factory):
    """speech borrows vision's 4 GPUs; vision asks for them: one of speech's jobs is preempted,
    once, and requeued; vision's job runs on what it freed while the victim waits for quota, instead
    of the victim (submitted first) taking them back and the reclaim preempting again."""
    d = daemon_factory(extra_config=COHORT)
    for i in (1, 2):
        add_sshd_node(d, sshd_factory(f"n{i}", d.public_key))
    c = d.client()  # alice: team vision
    bob = d.client(c.create_token("bob", "user")["token"])
    borrowed = [bob.submit({"command": ["sleep", "120"], "gpus": 4}) for _ in range(2)]
    for j in borrowed:
        wait_job(c, j["id"], "RUNNING")
    mine = c.submit({"command": ["sleep", "120"], "gpus": 4})
    wait_job(c, mine["id"], "RUNNING", timeout=30)
    victim = wait_for(lambda: next((j for j in (c.job(b["id"]) for b in borrowed)
                                    if j["state"] == "PENDING" and j["reason"] == "AssocGrpGRES"), None),
                      15, what="the requeued victim waits for quota")
    assert "team vision" in victim["reason_detail"] and "nominal" in victim["reason_detail"]
    time.sleep(4)  # four grace periods: a second reclaim would have happened by now
    preempts = [e for e in c.events(limit=2000) if e["action"] == "job.preempt"]
    assert len(preempts) == 1 and preempts[0]["target"] == str(victim["id"])
    assert c.job(mine["id"])["state"] == "RUNNING" and c.job(victim["id"])["state"] == "PENDING"
