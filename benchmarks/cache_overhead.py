"""Cache overhead through the real CLI and Prefect: cold tiny lifecycle vs a no-change rerun.

``llmpipe run configs/tiny.yaml`` into one fresh store, as a user would, against a Prefect server
like the one ``llmpipe server`` runs: cold, then with nothing changed (every stage ``Cached``); then
once more with no server, where Prefect starts a temporary one for the run. The baseline is the cold
run; goals: the rerun with a server up takes < 5% of it and under 10 s. Beside it, on the same server,
a bare Prefect flow of as many cached no-op tasks (results persisted to a path, keyed by a constant):
what Prefect itself costs, so the rest is ours. Each rerun is repeated
(``--reruns``, default 3) and the median counts: one rerun is a few seconds, so a busy machine moves
it by a large fraction. CPU seconds of the CLI and its children are printed beside the wall times.

    python benchmarks/cache_overhead.py [--reruns N] [overrides ...]
"""

from __future__ import annotations

import os
import sys

# benchmarks/tokenize.py would shadow the stdlib module: drop this folder from the import path first
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import argparse  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def cli_run(tmp: Path, env: dict[str, str], overrides: list[str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds, stdout) of one ``llmpipe run``."""
    cmd = [sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", f"store={tmp / 'store'}",
           f"state_dir={tmp / 'state'}", *overrides]
    cpu0, t0 = _children_cpu(), time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    secs, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if r.returncode != 0:
        raise SystemExit(f"llmpipe run failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return secs, cpu, r.stdout


BARE_FLOW = """
import sys
from pathlib import Path
from prefect import flow, task

@task(persist_result=True, cache_key_fn=lambda ctx, params: f"noop-{params['i']}",
      result_storage=Path(sys.argv[1]))
def noop(i: int) -> int:
    return i

@flow(name="bare-cached-noops")
def bare(n: int = 12) -> list[int]:
    return [noop(i) for i in range(n)]

bare(int(sys.argv[2]))
"""


def bare_run(tmp: Path, env: dict[str, str], tasks: int) -> tuple[float, float]:
    """(wall, CPU) seconds of one run of a plain Prefect flow of ``tasks`` cached no-op tasks."""
    results = tmp / "bare-results"
    results.mkdir(exist_ok=True)
    cpu0, t0 = _children_cpu(), time.perf_counter()
    r = subprocess.run([sys.executable, "-c", BARE_FLOW, str(results), str(tasks)], env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"the bare Prefect flow failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0, _children_cpu() - cpu0


def total_stages(table: str) -> int:
    """Rows of the CLI's stage table (every line after the header)."""
    lines = [ln for ln in table.splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.split()[:2] == ["stage", "key"]), len(lines))
    return len(lines) - start - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reruns", type=int, default=3, help="no-change reruns with the server (median counts)")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--quick", action="store_true", help="the test suite's small run (seconds, not a figure)")
    args = ap.parse_args()
    if args.quick:
        # ingest..quality on a tenth of the corpus: every step of the script (server, cold run, rerun, bare
        # flow, temporary server) at its smallest; the suite's caching tests cover every stage's reuse.
        # Under the test suite the server is its session's one (PREFECT_API_URL), started the same way
        args.reruns = 1
        args.overrides = ["ingest.sample=0.1", *args.overrides, "--flow", "data_refresh", "--until", "quality"]
    from flows import prefect_ops
    from llmpipe.processes import free_port

    shared = os.environ.get("PREFECT_API_URL") if args.quick else None
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        base_env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect-home"),
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        base_env.pop("PREFECT_API_URL", None)
        server, url = None, shared
        if url is None:
            port = free_port()
            server = prefect_ops.start_server(tmp / "server-state", port=port, timeout=300,
                                              extra_env={"PREFECT_HOME": str(tmp / "server-home")})
            url = f"http://127.0.0.1:{port}/api"
        env = {**base_env, "PREFECT_API_URL": url}
        try:
            cold, cold_cpu, out = cli_run(tmp, env, args.overrides)
            print(out)
            reruns: list[tuple[float, float]] = []
            bare: list[tuple[float, float]] = []
            stages = total_stages(out)
            bare_run(tmp, env, stages)  # fills its cache
            for _ in range(max(1, args.reruns)):
                secs, cpu, out = cli_run(tmp, env, args.overrides)
                reruns.append((secs, cpu))
                cached = sum(1 for line in out.splitlines() if " Cached " in f" {line} ")
                if cached != total_stages(out):
                    raise SystemExit(f"a no-change rerun recomputed stages:\n{out}")
                bare.append(bare_run(tmp, env, stages))
            print(out)
        finally:
            if server is not None:
                server.stop()
        temp_server, temp_cpu, _ = cli_run(tmp, base_env, args.overrides)
    rerun, rerun_cpu = statistics.median(s for s, _ in reruns), statistics.median(c for _, c in reruns)
    print(f"cold lifecycle (server up):                  {cold:7.1f} s  (CPU {cold_cpu:.1f} s)")
    print(f"no-change rerun (server up):                 {rerun:7.1f} s  (CPU {rerun_cpu:.1f} s; median of "
          f"{', '.join(f'{s:.2f}' for s, _ in reruns)}; {cached} stages Cached)")
    bare_s, bare_cpu = statistics.median(s for s, _ in bare), statistics.median(c for _, c in bare)
    print(f"bare Prefect flow, {stages} cached no-op tasks:  {bare_s:7.1f} s  (CPU {bare_cpu:.1f} s; median of "
          f"{', '.join(f'{s:.2f}' for s, _ in bare)})")
    print(f"no-change rerun (temporary Prefect server):  {temp_server:7.1f} s  (CPU {temp_cpu:.1f} s)")
    print(f"rerun / cold = {rerun / cold:.3f} (goal < 0.05), rerun = {rerun:.1f} s (goal < 10 s)")
    print(f"RESULT rerun_over_cold {rerun / cold:.4f} goal < 0.05")


if __name__ == "__main__":
    main()
