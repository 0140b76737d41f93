"""sbatch's options read with Slurm's parsing rules and meaning, resolved to an allocation."""

from __future__ import annotations

import pytest

from scheduler.slurm.sbatch import SbatchError, parse, parse_time_limit, split_directive

NOW = 1_700_000_000.0


def spec(script: str, *argv: str):
    return parse(script, list(argv), submit_dir="/home/alice/run", submit_host="login1", now=NOW)


def test_directives_stop_at_the_first_command():
    s = spec("#!/bin/bash\n#SBATCH -J one\n\n# a comment\n#SBATCH -N 2\necho hi\n#SBATCH -N 9\n")
    assert (s.name, s.nodes) == ("one", 2)


def test_an_indented_sbatch_line_is_a_comment():
    assert spec("#!/bin/bash\n  #SBATCH -N 4\n#SBATCH -J x\n").nodes == 1


def test_several_options_on_one_line_in_every_spelling():
    s = spec('#SBATCH -N2 --ntasks-per-node 4 --cpus-per-task=8 -J "my job" # trailing comment -N 9\n')
    assert (s.nodes, s.ntasks_per_node, s.cpus_per_task, s.name) == (2, 4, 8, "my job")


def test_quotes_group_and_are_removed():
    assert split_directive(" --comment='a b' -o \"out dir/%j.log\"") == ["--comment=a b", "-o", "out dir/%j.log"]


def test_unique_prefix_of_a_long_option_is_accepted():
    s = spec("#SBATCH --ntasks-per-n=2 --job=x\n")
    assert (s.ntasks_per_node, s.name) == (2, "x")
    with pytest.raises(SbatchError, match="'--tim' is ambiguous"):
        spec("#SBATCH --tim=10\n")


def test_command_line_wins_over_the_script():
    s = spec("#SBATCH -N 2 -t 1:00:00\n", "-N", "4")
    assert (s.nodes, s.time_limit_s) == (4, 3600)


def test_cpus_per_task_times_tasks_per_node_is_cpus_per_node():
    s = spec("#SBATCH --ntasks-per-node=4 --cpus-per-task=10\n")
    assert (s.ntasks, s.cpus_per_node) == (4, 40)


def test_gpus_is_the_job_total_split_over_nodes():
    s = spec("#SBATCH -N 2 --gpus=8\n")
    assert (s.gpus_per_node, s.gpus_total) == (4, 8)


@pytest.mark.parametrize("line, count, gpu_type", [
    ("--gres=gpu:a100:2", 2, "a100"), ("--gres=gpu:v100:4", 4, "v100"), ("--gres=gpu:a100", 1, "a100"),
    ("--gres=gpu", 1, None), ("--gres=gpu:4", 4, None), ("--gpus=a100:1", 1, "a100"),
    ("--gpus-per-node=h100:8", 8, "h100"), ("--ntasks-per-node=2 --gpus-per-task=2", 4, None),
])
def test_gpu_requests_keep_count_and_type(line, count, gpu_type):
    s = spec(f"#SBATCH {line}\n")
    assert (s.gpus_per_node, s.gpu_type) == (count, gpu_type)


@pytest.mark.parametrize("text, seconds", [
    ("30", 1800), ("10:30", 660), ("23:59:59", 86400), ("1-0", 86400), ("2-12:30", 217800),
    ("1-00:00:01", 86460), ("UNLIMITED", None), ("0", None),
])
def test_time_formats_round_up_to_the_minute(text, seconds):
    assert parse_time_limit(text) == seconds


def test_memory_per_cpu_and_per_gpu_scale_to_the_node():
    assert spec("#SBATCH --ntasks-per-node=2 -c 4 --mem-per-cpu=2G\n").mem_per_node_mb == 16 * 1024
    assert spec("#SBATCH --gpus-per-node=4 --mem-per-gpu=40G\n").mem_per_node_mb == 160 * 1024


def test_mem_and_mem_per_cpu_together_are_refused_naming_both_lines():
    with pytest.raises(SbatchError, match=r"script line 1.*script line 2.*mutually exclusive"):
        spec("#SBATCH --mem=10G\n#SBATCH --mem-per-cpu=1G\n")


def test_a_placeholder_slurm_rejects_is_refused_with_line_and_meaning():
    with pytest.raises(SbatchError) as e:
        spec("#!/bin/bash\n#SBATCH -J x\n#SBATCH --nodes=NUM_NODES\n")
    msg = str(e.value)
    assert "script line 3: #SBATCH --nodes=NUM_NODES" in msg
    assert "invalid node count 'NUM_NODES'" in msg and "number of nodes" in msg


def test_unknown_option_is_refused_by_name():
    with pytest.raises(SbatchError, match="unrecognized option '--gpu-count'"):
        spec("#SBATCH --gpu-count=2\n")


def test_constraint_features_are_kept_as_an_expression():
    assert spec("#SBATCH -C 'gpu&(a100|h100)'\n").constraint == "gpu&(a100|h100)"


def test_array_default_output_and_limit():
    s = spec("#SBATCH --array=0-15%4\n")
    assert (s.array, s.output) == ("0-15%4", "slurm-%A_%a.out")
    assert spec("#SBATCH -J x\n").output == "slurm-%j.out"


def test_signal_with_batch_flag_and_default_time():
    s = spec("#SBATCH --signal=B:USR1@90\n")
    assert (s.signal.name, s.signal.seconds, s.signal.batch_only) == ("USR1", 90, True)
    assert spec("#SBATCH --signal=SIGTERM\n").signal.seconds == 60


def test_options_trainyard_does_not_act_on_give_one_warning_line():
    s = spec("#SBATCH --qos=high --mail-type=END,FAIL --mail-user=a@b.c\n#SBATCH --requeue --wckey=w\n")
    assert s.warning() == "sbatch: warning: recorded but not acted on by trainyard: --qos, --requeue, --wckey"
    body = s.to_submit_body("x")  # mail is sent by the daemon's notifications: no warning for it
    assert (body["mail_type"], body["mail_user"], body["recorded"]) == (["END", "FAIL"], "a@b.c",
                                                                        {"qos": "high", "requeue": "", "wckey": "w"})
    acted = spec("#SBATCH --signal=B:USR1@90 --begin=now+1hour -w n1 -x n2 --mail-type=END\n")
    assert acted.warning() is None and acted.signal.name == "USR1"


def test_invalid_mail_type_is_refused():
    with pytest.raises(SbatchError, match="invalid mail type NEVER"):
        spec("#SBATCH --mail-type=NEVER\n")


def test_chdir_relative_to_submit_dir_and_hold():
    s = spec("#SBATCH -D sub -H\n")
    assert (s.workdir, s.hold) == ("/home/alice/run/sub", True)


def test_begin_relative_time():
    assert spec("#SBATCH --begin=now+1hour\n").begin == NOW + 3600


def test_export_values_become_job_environment():
    s = spec("#SBATCH --export=ALL,NCCL_DEBUG=INFO\n")
    assert (s.export, s.env) == ("ALL", {"NCCL_DEBUG": "INFO"})


def test_submit_body_carries_the_allocation():
    body = spec("#SBATCH -N 2 --ntasks-per-node=4 -c 8 --gres=gpu:a100:4 --mem=200G -t 2:00:00 -p gpu "
                "-A ml -o logs/%x-%j.out\n").to_submit_body("echo")
    assert body == {
        "script": "echo", "name": "sbatch", "nodes": 2, "gpus": 4, "cpus": 32, "ntasks": 8,
        "ntasks_per_node": 4, "cpus_per_task": 8, "output": "logs/%x-%j.out", "workdir": "/home/alice/run",
        "submit_dir": "/home/alice/run", "submit_host": "login1", "hold": False, "exclusive": False,
        "batch_step": True,
        "gpu_type": "a100", "mem": "204800M", "time_limit": 7200, "queue": "gpu", "account": "ml",
    }
