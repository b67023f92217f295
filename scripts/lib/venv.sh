# Shared by scripts/test, scripts/demo and the benchmarks: make ./.venv with slurmft and its extras.
# torch is installed first and pinned: 2.13.0 is the CPU build on local disk, while an unpinned
# torch would pull a multi-GB CUDA build.

ensure_python() {
    if python3 -c 'import sys, venv, ensurepip; assert sys.version_info >= (3, 11)' 2>/dev/null; then
        return 0
    fi
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "installing python3-venv (apt)..." >&2
        apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            python3 python3-venv python3-dev >&2
    else
        echo "need Python >= 3.11 with venv (Debian: apt-get install python3-venv)" >&2
        return 1
    fi
}

ensure_venv() {
    ensure_python
    if [[ ! -x .venv/bin/python ]]; then
        echo "creating .venv" >&2
        python3 -m venv .venv
        .venv/bin/python -m pip install -q --upgrade pip >&2
    fi
    if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
        echo "installing torch 2.13.0 (CPU build)" >&2
        .venv/bin/python -m pip install -q torch==2.13.0 >&2
    fi
    echo "installing slurmft with its extras" >&2
    .venv/bin/python -m pip install -q -e '.[train,postgres,dev,report,lightning,hf]' >&2
    # slurmft's own bytecode, once: an editable install compiles nothing, and where
    # PYTHONDONTWRITEBYTECODE is set (CI images often set it) every process that imports slurmft
    # (each agent, batch step, CLI call and training rank) would compile its modules again,
    # about 0.15-0.2 s of CPU each (scripts/bench/imports.py). A stale file is recompiled in
    # memory, never trusted: Python checks the source's mtime.
    .venv/bin/python -m compileall -q -j 0 slurmft migrations >/dev/null
}
