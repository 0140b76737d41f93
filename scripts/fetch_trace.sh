#!/usr/bin/env bash
# Fetch a public GPU-cluster trace for `trainyard simulate --trace ...`. Nothing is committed
# here: the data lives in its owners' repositories.
#
#   scripts/fetch_trace.sh alibaba [DEST]  Alibaba's cluster-trace-gpu-v2023 pod list (Weng et
#                                          al., ATC'23): 8,152 pods of a 6,212-GPU production
#                                          cluster; 600 kB; needs curl (or python3) and github.com.
#                                          default DEST: ../shared/data/traces/alibaba-gpu-2023
#   scripts/fetch_trace.sh helios [DEST]   SenseTime's Helios logs (Hu et al., SC'21, CC BY 4.0):
#                                          DEST/<cluster>/cluster_log.csv; needs git, git-lfs.
#                                          default DEST: ../shared/data/traces/helios
#   scripts/fetch_trace.sh DEST            the same as `helios DEST` (this script's first form)
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
source=helios
case "${1:-}" in
  alibaba|helios) source=$1; shift ;;
  -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac

download() {  # URL FILE
  if command -v curl >/dev/null; then
    curl -fsSL --retry 3 -o "$2" "$1"
  else
    python3 -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' "$1" "$2"
  fi
}

fetch_alibaba() {
  local dest=${1:-"$root/../shared/data/traces/alibaba-gpu-2023"}
  local base=https://raw.githubusercontent.com/alibaba/clusterdata/master/cluster-trace-gpu-v2023
  # the files the figures in docs/simulation.md were measured on
  local -A sums=(
    [openb_pod_list_default.csv]=1ee7ed79c27a3b0861cda8ddba86a004c6aba904caafa329a76ae93ca63834a8
    [openb_node_list_gpu_node.csv]=2beca64b4d3dfa342036a34b56a495c6cef9225db836c81f541282cb1df320b5
  )
  mkdir -p "$dest"
  local f
  for f in openb_pod_list_default.csv openb_node_list_gpu_node.csv; do
    if [ ! -s "$dest/$f" ]; then
      if ! download "$base/csv/$f" "$dest/$f.part"; then
        rm -f "$dest/$f.part"
        echo "fetch_trace: cannot download $base/csv/$f (no network to github.com?)." >&2
        echo "Fetch it elsewhere and copy it to $dest/$f." >&2
        exit 1
      fi
      mv "$dest/$f.part" "$dest/$f"
    fi
    if command -v sha256sum >/dev/null &&
       [ "$(sha256sum "$dest/$f" | cut -d' ' -f1)" != "${sums[$f]}" ]; then
      echo "fetch_trace: warning: $f differs from the file docs/simulation.md measured" >&2
    fi
  done
  [ -s "$dest/README.md" ] || download "$base/README.md" "$dest/README.md" 2>/dev/null || true
  echo "fetched Alibaba's GPU pod list into $dest; its recipe (docs/simulation.md):"
  echo "  trainyard simulate --trace $dest/openb_pod_list_default.csv \\"
  echo "      --window 9504000 12902400 --load 0.8 --policy fifo,las,las-budget,qssf,oracle"
}

fetch_helios() {
  local repo=https://github.com/S-Lab-System-Group/HeliosData
  local dest=${1:-"$root/../shared/data/traces/helios"}
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
    git lfs pull || echo "fetch_trace: git lfs pull failed; trying the repository's own files" >&2
  fi
  if [ -f data.zip ]; then  # the repository now ships its logs zipped
    command -v unzip >/dev/null || { echo "fetch_trace: $repo holds data.zip: install unzip" >&2; exit 1; }
    unzip -tq data.zip >/dev/null 2>&1 && unzip -q data.zip
  fi
  if [ -x ./download.sh ] && [ -z "$(find . -name cluster_log.csv -size +1k | head -1)" ]; then
    ./download.sh
  fi
  local found=0 f cluster
  while IFS= read -r f; do
    [ -s "$f" ] || continue
    head -1 "$f" | grep -q "gpu_num" || continue  # an LFS pointer, not the data
    cluster=$(basename "$(dirname "$f")")
    mkdir -p "$dest/$cluster"
    cp "$f" "$dest/$cluster/cluster_log.csv"
    found=$((found + 1))
  done < <(find . -name cluster_log.csv)
  [ -f LICENSE.txt ] && cp LICENSE.txt "$dest/LICENSE" || true
  if [ "$found" = 0 ]; then
    echo "fetch_trace: no cluster_log.csv with data in $repo; see its README for the download" >&2
    exit 1
  fi
  echo "fetched $found cluster log(s) into $dest; e.g."
  echo "  trainyard simulate --trace $dest/$(ls "$dest" | grep -v LICENSE | head -1)/cluster_log.csv --load 0.8 --policy fifo,las,qssf,oracle"
}

"fetch_$source" "$@"
