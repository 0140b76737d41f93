"""Real batch scripts from public repositories: each must parse to the allocation Slurm gives.

The corpus keeps only each script's directive lines and a line naming its source (repository,
commit and path). Expectations were worked out from Slurm's documented meaning of each option.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scheduler.slurm.sbatch import SbatchError, parse

CORPUS = Path(__file__).parent / "corpus"
SCRIPTS = sorted(CORPUS.glob("*.sbatch"))

# file: (nodes, ntasks, tasks/node, GPUs/node, GPU type, CPUs/node, MiB/node, seconds, array,
#        name, output, partition)
G = 1024
EXPECTED = {
    "01-vit-clouds-torchrun": (1, 1, 1, 4, None, 1, None, 1800, None, "test", "%x_%A.out", "gpu"),
    "02-urs-ddp": (1, 1, 1, 2, None, 1, None, None, None, "02-urs-ddp.sbatch", "slurm-%j.out", "rtx2080"),
    "03-pytorch-multigpu": (1, 1, 1, 2, None, 1, 8 * G, None, None, "mgpu4", "slurm-%j.out", "batch"),
    "04-deepspeed-two-nodes": (2, 2, 1, 0, None, 32, None, None, None, "dli_moe2nodes",
                               "/dli/megatron/logs/%j.out", None),
    "05-pal-array": (1, 1, 1, 1, None, 10, 64 * G, 18000, "1-50", "visu", "./logs/visu/%A/%a.out", None),
    "06-poleval-a100": (1, 1, 1, 1, None, 8, None, 3600, None, "06-poleval-a100.sbatch", "slurm-%j.out",
                        "plgrid-gpu-a100"),
    "07-suger-beluga": (1, 4, 4, 1, None, 4, 32 * G, None, None, "07-suger-beluga.sbatch", "slurm-%j.out",
                        None),
    "08-bgcn-cedar": (1, 4, 4, 1, None, 4, 128 * G, None, None, "08-bgcn-cedar.sbatch", "slurm-%j.out", None),
    "09-cedar-whole-node": (1, 24, 24, 4, None, 24, 125 * G, 180, None, "09-cedar-whole-node.sbatch",
                            "slurm-%j.out", None),
    "10-chexnet": (1, 1, 1, 4, None, 1, 128, 172800, None, "10-chexnet.sbatch", "slurm-%j.out", "gpu"),
    "11-puhti-horovod-one-line": (1, 4, 4, 4, "v100", 40, 64 * G, 3600, None,
                                  "11-puhti-horovod-one-line.sbatch", "slurm-%j.out", "gpu"),
    "12-genbert-finetune": (1, 1, 1, 1, None, 8, 64 * G, None, None, "12-genbert-finetune.sbatch",
                            "slurm-%j.out", "gpu"),
    "13-hanscripter-a100": (1, 1, 1, 1, "a100", 1, None, 21600, None, "finetune", "slurm-%j.out", "gpu"),
    "14-gama-feature": (1, 1, 1, 1, None, 5, 80 * G, None, None, "14-gama-feature.sbatch",
                        "logs/output_finetuning_%j.out", "gpu"),
    "15-nodelist-qos": (1, 1, 1, 1, None, 32, 80 * G, 86400, None, "finetune", "finetune.log", "hi-res"),
    # a bare `--mem=32G` line is a command: Slurm stops reading directives there
    "16-broken-line-ends-directives": (1, 1, 1, 0, None, 16, None, None, None, "test", "slurm-%j.out", None),
    "17-puhti-pytorch-one-line": (1, 1, 1, 1, "v100", 10, 64 * G, 3600, None,
                                  "17-puhti-pytorch-one-line.sbatch", "slurm-%j.out", "gpu"),
    "18-gconet-v100": (1, 10, 10, 1, "v100", 10, None, 172800, None, "18-gconet-v100.sbatch",
                       "slurm-%j.out", None),
    "19-gpulab-qos": (1, 2, 2, 1, None, 2, None, None, None, "pytorch_test", "test/zjob.%j.log", "gpulab02"),
    "20-jupyter-l40": (1, 1, 1, 1, "L40", 4, 500 * G, 86400, None, "mihirgpu", "slurm-%j.out", "general"),
    "21-narval-a100": (1, 12, 12, 1, "a100", 12, 64 * G, 39600, None, "data1", "%x-%j.out", None),
    "22-p100-whole-node": (1, 24, 24, 4, "p100", 24, 125 * G, 180, None, "22-p100-whole-node.sbatch",
                           "slurm-%j.out", None),
    # --tasks is a unique prefix of --tasks-per-node (getopt_long), so 80 tasks on the node
    "23-tasks-prefix": (1, 80, 80, 0, None, 80, 40 * G, 120, None, "23-tasks-prefix.sbatch", "finall.out",
                        "gpu4"),
    "24-nodelist-torchrun": (1, 1, 1, 2, None, 16, None, None, None, "24-nodelist-torchrun.sbatch",
                             "temp.out", None),
    "25-double-space": (1, 1, 1, 1, None, 1, 50 * G, None, None, "25-double-space.sbatch",
                        "logs/sbatch_log/%j.out", None),
    "26-matching-or-constraint": (1, 1, 1, 1, None, 6, 300 * G, 604800, None, "train", "train.%J.out", "batch"),
    "27-sheffield-qos": (1, 1, 1, 1, None, 32, 150 * G, 345600, None, "27-sheffield-qos.sbatch",
                         "slurm-%j.out", "gpu"),
    "28-lightning-32-nodes": (32, 64, 2, 2, None, 2, None, 43200, None, "lightning_test", "slurm-%j.out",
                              "gpu2"),
    "29-signal-or-constraint": (1, 1, 1, 1, None, 8, 32000, 86400, None, "gpu", "slurm-%j.out", "killable"),
    "30-signal-exclude": (1, 1, 1, 1, None, 32, 220 * G, 172800, None, "30-signal-exclude.sbatch",
                          "slurm/test-pyt.%j.out", "gpu"),
}


def load(path: Path):
    return parse(path.read_text(), [], submit_dir="/home/u/run", submit_host="login1", now=0.0,
                 default_name=path.name)


def test_the_corpus_has_thirty_sourced_scripts():
    assert len(SCRIPTS) >= 30
    for path in SCRIPTS:
        assert path.read_text().splitlines()[1].startswith("# source: https://github.com/"), path.name
    assert {p.stem for p in SCRIPTS} == set(EXPECTED)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_script_gets_the_allocation_slurm_gives(path):
    s = load(path)
    got = (s.nodes, s.ntasks, s.ntasks_per_node, s.gpus_per_node, s.gpu_type, s.cpus_per_node,
           s.mem_per_node_mb, s.time_limit_s, s.array, s.name, s.output, s.partition)
    assert got == EXPECTED[path.stem]


def test_fraction_that_parses_unchanged():
    refused = []
    for path in SCRIPTS:
        try:
            load(path)
        except SbatchError as e:
            refused.append(f"{path.name}: {e}")
    print(f"\ncorpus: {len(SCRIPTS) - len(refused)}/{len(SCRIPTS)} scripts parse unchanged")
    assert not refused


NODES = ("huang-l40s-1", "ttnusa6")  # named by -w in 15-nodelist-qos and 24-nodelist-torchrun
PARTITIONS = sorted({e[11] for e in EXPECTED.values() if e[11]})


def test_fraction_that_runs_unchanged_on_a_daemon(daemon_factory, sshd_factory):
    """Each script submitted as is (held) to a real daemon whose one queue carries the corpus's
    partition names as aliases; it runs unchanged when the daemon takes it and records the
    allocation Slurm would give. The cluster has two nodes: a script asking for more is refused,
    as Slurm refuses it on a cluster that small. The README's figure is this test's."""
    import json
    import subprocess
    import sys

    from tests.conftest import add_sshd_node

    d = daemon_factory(extra_config=f"\n[queues.gpu]\naliases = {json.dumps([p for p in PARTITIONS if p != 'gpu'])}\n")
    env = {**d.env, "TRAINYARD_URL": d.url, "TRAINYARD_TOKEN": d.token}
    c = d.client()
    # the nodes the corpus names with -w exist, as real sshd nodes with every feature it asks for
    features = {f for p in SCRIPTS if (cons := load(p).constraint) for f in re.findall(r"[\w.-]+", cons)}
    for name in NODES:
        add_sshd_node(d, sshd_factory(name, d.public_key), gpus=8, labels=dict.fromkeys(features, ""))
    failures = []
    for path in SCRIPTS:
        r = subprocess.run([sys.executable, "-m", "scheduler.slurm.commands_main", "sbatch", "--hold",
                            "--parsable", str(path)], env=env, capture_output=True, text=True, timeout=60,
                           cwd=d.base)
        if r.returncode != 0:
            failures.append(f"{path.stem}: refused: {r.stderr.strip().splitlines()[-1]}")
            continue
        nodes, _ntasks, _tpn, gpus, gpu_type, cpus, mem, seconds, array, name, _out, part = EXPECTED[path.stem]
        job = c.job(int(r.stdout.strip().split("_")[0]))
        got = (job["nodes"], job["gpus"], job["gpu_type"], job["cpus"], job["time_limit"], job["name"],
               job["queue"])
        want = (nodes, gpus, gpu_type, cpus, seconds, name, "gpu" if part else "default")
        if mem is not None:
            got, want = got + (job["mem"],), want + (mem,)
        if array is not None:
            tasks = [j for j in c.jobs(all=True) if j["array_job_id"] == job["array_job_id"]]
            got, want = got + (len(tasks),), want + (len(list(_indices(array))),)
        if got != want:
            failures.append(f"{path.stem}: got {got}, Slurm gives {want}")
    ran = len(SCRIPTS) - len(failures)
    print(f"\ncorpus: {ran}/{len(SCRIPTS)} ({100 * ran / len(SCRIPTS):.0f} %) scripts run unchanged "
          "with Slurm's allocation")
    for f in failures:
        print("  " + f)
    assert ran >= 0.9 * len(SCRIPTS), failures


def _indices(spec: str):
    for part in spec.split("%")[0].split(","):
        first, _, rest = part.partition("-")
        last, _, step = rest.partition(":")
        yield from range(int(first), int(last or first) + 1, int(step or 1))


def test_recorded_options_are_named_in_the_warning():
    assert load(CORPUS / "30-signal-exclude.sbatch").warning() is None  # both acted on
    s = load(CORPUS / "29-signal-or-constraint.sbatch")
    assert s.constraint == "tesla_v100|quadro_rtx_8000|geforce_rtx_3090|a100|a5000|a6000"
    assert (s.signal.name, s.signal.seconds) == ("USR1", 120)
    assert load(CORPUS / "24-nodelist-torchrun.sbatch").nodelist == ["ttnusa6"]
    assert load(CORPUS / "09-cedar-whole-node.sbatch").exclusive
