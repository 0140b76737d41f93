#!/usr/bin/env bash
# Fetch SenseTime's Helios GPU-cluster traces (Hu et al., SC'21; CC BY 4.0) for
# `trainyard simulate --trace DIR/<cluster>/cluster_log.csv`. The data is not committed here:
# it is large and lives in its own repository. Needs git and git-lfs and access to github.com.
#
#   scripts/fetch_trace.sh [DEST]     (default: ../shared/data/traces/helios)
set -euo pipefail

repo=https://github.com/S-Lab-System-Group/HeliosData
dest=${1:-"$(cd "$(dirname "$0")/.." && pwd)/../shared/data/traces/helios"}

command -v git >/dev/null || { echo "fetch_trace: git is not installed" >&2; exit 1; }
if [ -n "$(find "$dest" -name cluster_log.csv 2>/dev/null | head -1)" ]; then
    echo "already here: $(find "$dest" -name cluster_log.csv | tr '\n' ' ')"
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! GIT_LFS_SKIP_SMUDGE=1 git clone --depth 1 "$repo" "$tmp/HeliosData"; then
    echo "fetch_trace: cannot clone $repo (no network to github.com?)." >&2
    echo "Fetch it elsewhere and copy its cluster_log.csv files under $dest/<cluster>/." >&2
    exit 1
fi
cd "$tmp/HeliosData"
if git lfs version >/dev/null 2>&1; then
    git lfs pull || echo "fetch_trace: git lfs pull failed; trying the repository's own script" >&2
fi
if [ -x ./download.sh ] && [ -z "$(find . -name cluster_log.csv -size +1k | head -1)" ]; then
    ./download.sh
fi
found=0
while IFS= read -r f; do
    [ -s "$f" ] || continue
    head -1 "$f" | grep -q "gpu_num" || continue  # an LFS pointer, not the data
    cluster=$(basename "$(dirname "$f")")
    mkdir -p "$dest/$cluster"
    cp "$f" "$dest/$cluster/cluster_log.csv"
    found=$((found + 1))
done < <(find . -name cluster_log.csv)
[ -f LICENSE ] && cp LICENSE "$dest/LICENSE" || true
if [ "$found" = 0 ]; then
    echo "fetch_trace: no cluster_log.csv with data in $repo; see its README for the download" >&2
    exit 1
fi
echo "fetched $found cluster log(s) into $dest; e.g."
echo "  trainyard simulate --trace $dest/$(ls "$dest" | grep -v LICENSE | head -1)/cluster_log.csv --load 0.8 --policy fifo,las,qssf,oracle"
