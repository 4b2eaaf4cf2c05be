#!/usr/bin/env bash
# Mutation testing with mutmut, one module at a time, with only that module's tests.
#
#   scripts/mutation.sh sampling [scheduler kv_cache engine openai]
#
# Modules and their tests: [tool.mutmut.modules] in pyproject.toml. Each module runs in its own
# copy of the committed tree (git archive $MUTATION_REF, default HEAD) under $MUTATION_DIR
# (default /tmp/heterollm-mutation/MODULE), so edits in progress in the work tree neither leak in
# nor get mutated. Prints mutmut's summary and the surviving mutants; record the dated kill rate
# and a verdict for each survivor in tests/MUTATION.md. Not part of CI: too slow. Rerun a module
# when it changes.
#
# Cores: $MUTATION_JOBS mutants at a time (default 1: the machine is shared).
# Sample: MUTATION_SAMPLE=N runs N mutants drawn uniformly at random (seed $MUTATION_SEED, default 0)
# instead of all; sample.txt lists them, sample-run.txt ends with each one's result. A module of
# thousands of mutants costs ~17 core-hours on this project's 2-vCPU machine; a sample of a few
# hundred gives its kill rate within a few points (tests/MUTATION.md gives the interval).
# Install: `pip install -e '.[test]'` brings mutmut (>= 3.8; it installs next to torch 2.13 with
# no conflict), or `.venv/bin/pip install 'mutmut>=3.8'`.
set -euo pipefail

ROOT=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
PY=${PYTHON:-$ROOT/.venv/bin/python}
MUTMUT=${MUTMUT:-$(dirname "$PY")/mutmut}
REF=${MUTATION_REF:-HEAD}
JOBS=${MUTATION_JOBS:-1}
[ $# -ge 1 ] || { echo "usage: $0 MODULE... (modules: $("$PY" - "$ROOT" <<'EOF'
import sys, tomllib
print(" ".join(tomllib.load(open(sys.argv[1] + "/pyproject.toml", "rb"))["tool"]["mutmut"]["modules"]))
EOF
))" >&2; exit 2; }

for module in "$@"; do
  work=${MUTATION_DIR:-/tmp/heterollm-mutation}/$module
  rm -rf "$work"
  mkdir -p "$work"
  git -C "$ROOT" archive "$REF" | tar -x -C "$work"
  # mutmut names a mutant after its file's path, dropping only a leading "src/": with the package
  # under src/ the names match the modules the tests import (heterollm.sampling.sampler)
  mv "$work/framework" "$work/src"
  # this module's source_paths and tests in [tool.mutmut]; the modules table itself is dropped
  "$PY" - "$work/pyproject.toml" "$module" <<'EOF'
import re, sys, tomllib
path, module = sys.argv[1], sys.argv[2]
text = open(path).read()
modules = tomllib.loads(text)["tool"]["mutmut"]["modules"]
if module not in modules:
    sys.exit(f"unknown module {module!r}; known: {', '.join(modules)}")
entry = {key: [p.replace("framework/", "src/", 1) for p in value] for key, value in modules[module].items()}
lines, skipping = [], False
for line in text.splitlines(keepends=True):  # drop the [tool.mutmut.modules] table, up to the next header
    if line.startswith("["):
        skipping = line.strip() == "[tool.mutmut.modules]"
    if not skipping:
        lines.append(line)
text = "".join(lines)
text = re.sub(r"(?m)^also_copy = .*$", 'also_copy = ["src/", "README.md", "scripts/"]', text)  # fixtures start scripts/*.sh
text = re.sub(r"(?m)^source_paths = .*$", "source_paths = " + repr(entry["paths"]).replace("'", '"'), text)
text = re.sub(r"(?m)^pytest_add_cli_args_test_selection = .*$",
              "pytest_add_cli_args_test_selection = " + repr(entry["tests"]).replace("'", '"'), text)
open(path, "w").write(text)
EOF
  echo "== $module: mutmut in $work ($(git -C "$ROOT" rev-parse --short "$REF"), $JOBS at a time)"
  (
    cd "$work"
    # mutmut puts mutants/src first on sys.path itself (naming it in PYTHONPATH before it exists
    # would hide it: Python caches a missing folder as having no modules); the CPU backend comes
    # from the same copy
    export PYTHONPATH="$work/backends/cpu${PYTHONPATH:+:$PYTHONPATH}"
    export HETEROLLM_CACHE_DIR=${HETEROLLM_CACHE_DIR:-$work/.cache}
    export PYTHON="$PY"  # the copy has no .venv: scripts/mooncake.sh finds mooncake_master beside this python
    if [ -n "${MUTATION_SAMPLE:-}" ]; then
      # A uniform random sample of the module's mutants (seeded: the same commit and seed give the
      # same sample), for an unbiased kill-rate estimate where the whole module costs core-hours.
      # mutmut's own order runs the mutants whose tests are cheapest first: a biased sample.
      "$PY" - "$MUTATION_SAMPLE" "${MUTATION_SEED:-0}" > "$work/sample.txt" <<'PYEOF'
import contextlib, glob, json, os, random, sys
from mutmut.__main__ import copy_also_copy_files, copy_src_dir, create_mutants, setup_source_paths
with contextlib.redirect_stdout(sys.stderr):  # create_mutants prints each file it walks
    os.makedirs("mutants", exist_ok=True)
    copy_src_dir(); copy_also_copy_files(); setup_source_paths(); create_mutants(1)
names = sorted(key for meta in glob.glob("mutants/**/*.meta", recursive=True)
               for key in json.load(open(meta))["exit_code_by_key"])
size, seed = int(sys.argv[1]), int(sys.argv[2])
print(f"sampling {min(size, len(names))} of {len(names)} mutants, seed {seed}", file=sys.stderr)
print("\n".join(sorted(random.Random(seed).sample(names, min(size, len(names))))))
PYEOF
      # with names given, mutmut ends by printing each one's result
      xargs -a "$work/sample.txt" "$MUTMUT" run --max-children "$JOBS" | tee "$work/sample-run.txt" || true
    else
      "$MUTMUT" run --max-children "$JOBS" || true
    fi
    "$MUTMUT" results --all false 2>/dev/null | tee "$work/survivors.txt" || true
  )
done
