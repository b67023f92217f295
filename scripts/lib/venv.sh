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
    install_venv_packages
    compile_venv
}

# The packages without their bytecode (compile_venv writes it): pip compiles each file as it
# unpacks it, on one core, and that is most of an install here (about 40 s of CPU for the 13,000
# modules of torch, transformers, lightning and the rest, against some 20 s for the rest of pip's
# work).
install_venv_packages() {
    ensure_python
    if [[ ! -x .venv/bin/python ]]; then
        echo "creating .venv" >&2
        python3 -m venv .venv
        .venv/bin/python -m pip install -q --upgrade pip >&2
    fi
    local compiling_torch=""
    if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
        echo "installing torch 2.13.0 (CPU build)" >&2
        .venv/bin/python -m pip install -q --no-compile torch==2.13.0 >&2
        # torch and what it brought (sympy, networkx, ...) are a third of the bytecode: compiled
        # while pip installs the rest, which mostly waits on the package indexes. A file pip
        # replaces meanwhile is compiled again below (bytecode records its source's size, mtime).
        compile_venv "$(venv_site_packages)"/* &
        compiling_torch=$!
    fi
    echo "installing slurmft with its extras" >&2
    .venv/bin/python -m pip install -q --no-compile \
        -e '.[train,postgres,dev,report,lightning,hf]' >&2
    if [[ -n $compiling_torch ]]; then wait "$compiling_torch"; fi
}

# Every module's bytecode, on all cores, before anything imports them. Where
# PYTHONDONTWRITEBYTECODE is set (CI images often set it) nothing else would ever write it, and
# every process (each agent, batch step, CLI call and training rank) would compile its imports
# again: `import torch` alone would take twice its CPU. An editable install compiles nothing of
# slurmft itself, so it is compiled here too. Up-to-date files are skipped (a second call takes a
# few seconds); a stale one is recompiled in memory, never trusted: Python checks the source's
# mtime and size. A file that does not compile (torch ships one written for Python 3.12) is left
# as pip leaves it: it would fail at import whatever was written.
compile_venv() { # [paths: only these]
    if [[ $# -eq 0 ]]; then set -- "$(venv_site_packages)" slurmft migrations; fi
    .venv/bin/python -m compileall -qq -j 0 "$@" >/dev/null || true
}

venv_site_packages() {
    .venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}
