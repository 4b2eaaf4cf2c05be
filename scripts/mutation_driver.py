"""Run the mutants of a sample that mutmut has not checked, one at a time, each in a fresh interpreter.

    .venv/bin/python scripts/mutation_driver.py WORK [RESULTS]

WORK is a module's folder from `MUTATION_SAMPLE=N scripts/mutation.sh MODULE` (it holds sample.txt
and mutants/); RESULTS (default WORK/driver.txt) gets one line per mutant: its name and verdict
(killed, survived, no-tests, timeout) with the seconds it took. A mutant already in RESULTS is not
run again, so the driver resumes where it stopped.

Why: mutmut 3.8 runs each mutant in a child forked from its stats process; some server and engine
mutants that fail a test within seconds in a fresh interpreter hang in that child past any timeout.
The driver runs what mutmut's runner runs (the tests its stats map to the mutant's function, fastest
first, `-x`, MUTANT_UNDER_TEST set) in a new interpreter per mutant, with a time limit
(MUTATION_DRIVER_TIMEOUT, default 420 s).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    if len(sys.argv) not in (2, 3):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    work = Path(sys.argv[1]).resolve()
    results = Path(sys.argv[2]) if len(sys.argv) == 3 else work / "driver.txt"
    bindir = Path(sys.executable).parent
    limit = float(os.environ.get("MUTATION_DRIVER_TIMEOUT", "420"))
    names = (work / "sample.txt").read_text().split()
    listing = subprocess.run([str(bindir / "mutmut"), "results", "--all", "true"], cwd=work, capture_output=True,
                             text=True, check=True).stdout
    status = dict(line.strip().rsplit(": ", 1) for line in listing.splitlines() if ": " in line)
    stats = json.loads((work / "mutants" / "mutmut-stats.json").read_text())
    tests_by, duration = stats["tests_by_mangled_function_name"], stats["duration_by_test"]
    done = {line.split()[0] for line in results.read_text().splitlines()} if results.exists() else set()
    todo = [n for n in names if status.get(n) == "not checked" and n not in done]
    print(f"{len(todo)} mutants to run", flush=True)
    env = {**os.environ, "PYTHONPATH": f"{work}/backends/cpu:src", "OMP_NUM_THREADS": "1",
           "HETEROLLM_CACHE_DIR": os.environ.get("HETEROLLM_CACHE_DIR", f"{work}/.cache"), "PYTHON": sys.executable}
    for name in todo:
        tests = sorted(tests_by.get(name.rsplit("__mutmut_", 1)[0], []), key=lambda t: duration.get(t, 0))
        if not tests:
            verdict = "no-tests"
        else:
            start = time.time()
            try:
                run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                                      "--tb=line", *tests], cwd=work / "mutants", capture_output=True, text=True,
                                     env={**env, "MUTANT_UNDER_TEST": name}, timeout=limit)
                verdict = "survived" if run.returncode == 0 else f"killed(rc={run.returncode})"
            except subprocess.TimeoutExpired:
                verdict = f"timeout({limit:.0f}s)"
            verdict += f" {time.time() - start:.0f}s {len(tests)} tests"
        with results.open("a") as f:
            f.write(f"{name} {verdict}\n")
        print(name, verdict, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
