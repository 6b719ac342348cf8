#!/usr/bin/env bash
# The first hour on a new machine, checked (`make fresh-check`): the committed HEAD of this checkout cloned into a
# temporary folder, a new venv with the run dependencies only (`make demo` installs `-e .`: no dev extras, no
# torch), an empty model cache ($FP8RL_CACHE), then `make demo DEMO_ARGS=--steps=1`; afterwards `import torch` must
# fail in that venv (the demo may not need it). Prints the demo's exit status and wall time, and exits non-zero if
# either check fails.
#
# Needs PyPI (JAX and the rest, and the 93 MB model package): minutes. pip's own download cache is used as it is.
# Nothing outside the clone is read: no ../shared, no ~/.cache/fp8rl_jax. Uncommitted changes are not in the clone.
#   .ci/fresh_check.sh [--keep]     # --keep: leave the temporary folder (clone, venv, cache, demo.log) for a look
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
keep=0
[[ "${1:-}" == "--keep" ]] && keep=1
work="$(mktemp -d "${TMPDIR:-/tmp}/fp8rl_fresh.XXXXXX")"
cleanup() { if ((keep)); then echo "fresh-check: kept $work"; else rm -rf "$work"; fi; }
trap cleanup EXIT

head="$(git -C "$repo" rev-parse HEAD)"
git clone --quiet --no-checkout "$repo" "$work/repo"
git -C "$work/repo" checkout --quiet --detach "$head"
cd "$work/repo"

# a new machine's environment: an empty model cache, nothing on the path from this checkout
export FP8RL_CACHE="$work/cache"
unset PYTHONPATH VIRTUAL_ENV
echo "fresh-check: ${head:0:12} in $work/repo, FP8RL_CACHE=$FP8RL_CACHE, $("$python" --version)"

start=$(date +%s)
set +e
make demo DEMO_ARGS=--steps=1 PYTHON="$python" 2>&1 | tee "$work/demo.log"
rc=${PIPESTATUS[0]}
set -e
seconds=$(($(date +%s) - start))

status=0
if [[ ! -x .venv/bin/python ]]; then
    torch="no venv was made"
    status=1
elif .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    by="$(.venv/bin/python -m pip show torch 2>/dev/null | sed -n 's/^Required-by: //p')"
    torch="succeeds: FAIL (torch $(.venv/bin/python -c 'import torch; print(torch.__version__)'), required by: ${by:-nothing: installed by hand?})"
    status=1
else
    torch="fails: good (the run dependencies do not bring torch)"
fi
((rc == 0)) || status=1
echo "fresh-check: make demo DEMO_ARGS=--steps=1 exit status $rc in ${seconds} s (venv, model download and one step); import torch $torch"
exit "$status"
