"""scripts/fetch_trace.sh alibaba: downloads into DEST, says when it cannot, leaves no half file.

A stand-in `curl` first in PATH plays the network (this machine reaches no github.com)."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fetch_trace.sh"


def run(tmp_path, curl_body, dest):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    curl = bin_dir / "curl"
    curl.write_text("#!/bin/sh\n" + curl_body)
    curl.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return subprocess.run(["bash", str(SCRIPT), "alibaba", str(dest)], env=env,
                          capture_output=True, text=True, timeout=60)


def test_without_network_it_fails_naming_the_url_and_leaves_nothing_half_written(tmp_path):
    dest = tmp_path / "trace"
    r = run(tmp_path, 'echo "curl: (6) Could not resolve host" >&2; exit 6\n', dest)
    assert r.returncode == 1
    assert "cannot download https://raw.githubusercontent.com/alibaba/clusterdata" in r.stderr
    assert "openb_pod_list_default.csv" in r.stderr
    assert list(dest.iterdir()) == []


def test_a_download_lands_in_dest_and_a_changed_file_is_flagged(tmp_path):
    dest = tmp_path / "trace"
    # writes a small pod list wherever -o points
    body = ('while [ "$#" -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done\n'
            'printf "name,num_gpu,creation_time,scheduled_time,deletion_time\\n'
            'p1,1,0,0,10\\n" > "$out"\n')
    r = run(tmp_path, body, dest)
    assert r.returncode == 0, r.stderr
    assert (dest / "openb_pod_list_default.csv").read_text().startswith("name,num_gpu")
    assert "differs from the file docs/simulation.md measured" in r.stderr
    assert f"--trace {dest}/openb_pod_list_default.csv" in r.stdout
    assert not list(dest.glob("*.part"))


def test_helios_logs_shipped_in_a_zip_are_unpacked_into_one_folder_per_cluster(tmp_path):
    import zipfile

    # what HeliosData's repository holds now: its logs in data.zip; a stand-in `git` clones it
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("data/Venus/cluster_log.csv",
                   "job_id,user,vc,gpu_num,submit_time,duration\nj1,u1,vc1,1,2020-09-01 00:00:00,60\n")
        z.writestr("data/Venus/cluster_gpu_number.csv", "vc,gpu\nvc1,8\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    git = bin_dir / "git"
    git.write_text('#!/bin/sh\n[ "$1" = clone ] || exit 1\n'
                   f'for last; do :; done; mkdir -p "$last" && cp {archive} "$last/data.zip"\n')
    git.chmod(0o755)
    dest = tmp_path / "helios"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", str(SCRIPT), "helios", str(dest)], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (dest / "Venus" / "cluster_log.csv").read_text().startswith("job_id,user,vc,gpu_num")
    assert "fetched 1 cluster log(s)" in r.stdout
