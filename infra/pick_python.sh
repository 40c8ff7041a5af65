#!/usr/bin/env bash
# Prints the fastest CPython 3.11 on this machine that can make a venv; `make install` builds
# .venv with it. Why: every run and test starts dozens of Python processes (ranks, flows,
# servers), each spending seconds importing torch, transformers, MLflow and Prefect, and the
# interpreter's build sets that cost. Here Debian's /usr/bin/python3.11 (libpython linked into
# the executable) spends 14% less CPU on a pipeline than pyenv's 3.11 (libpython as a shared
# library): README, "Tests".
# 3.11 only: constraints.txt pins versions tested together on 3.11. `make PYTHON=...` overrides.
set -u
CANDIDATES=(python3.11 python3 /usr/bin/python3.11 /usr/local/bin/python3.11)
# one start per candidate: it checks itself, then prints its path and the best of 15
# runs of a pure-Python loop (~0.07 s; the import-heavy work is pure Python too)
PROBE='
import ensurepip, sys, time, venv
assert sys.version_info[:2] == (3, 11)
def work():
    d = {str(i): (i * 7) % 13 for i in range(200_000)}
    return sorted(d.items(), key=lambda kv: kv[1])[:3]
ts = []
for _ in range(15):
    t0 = time.perf_counter()
    work()
    ts.append(time.perf_counter() - t0)
print(sys.executable, f"{min(ts):.6f}")
'
best="" best_t="" seen=" "
for c in "${CANDIDATES[@]}"; do
    p=$(command -v "$c" 2>/dev/null) || continue
    real=$(readlink -f "$p")
    case "$seen" in *" $real "*) continue ;; esac  # one interpreter under two names: probe once
    seen="$seen$real "
    read -r _ t < <("$p" -c "$PROBE" 2>/dev/null) || continue
    if [ -z "$best" ] || awk "BEGIN{exit !($t < $best_t)}"; then
        best=$p best_t=$t
    fi
done
if [ -z "$best" ]; then
    echo "no CPython 3.11 with venv and ensurepip found (tried ${CANDIDATES[*]}): install one," \
        "or give it as make PYTHON=..." >&2
    exit 1
fi
echo "$best"
