"""Cache overhead through the real CLI and Prefect: cold tiny lifecycle vs a no-change rerun.

``llmpipe run configs/tiny.yaml`` three times into one fresh store, as a user would: cold, then with
nothing changed (every stage ``Cached``), both against a running Prefect server (``llmpipe server``);
then once more with no server, where Prefect starts a temporary one for the run. The baseline is the
cold run; goals: the rerun with a server takes < 5% of it and under 10 s.

    python benchmarks/cache_overhead.py [overrides ...]
"""

from __future__ import annotations

import os
import sys

# benchmarks/tokenize.py would shadow the stdlib module: drop this folder from the import path first
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import argparse  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def cli_run(tmp: Path, env: dict[str, str], overrides: list[str]) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", f"store={tmp / 'store'}",
           f"state_dir={tmp / 'state'}", *overrides]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"llmpipe run failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return secs, r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    from flows import ops
    from llmpipe.ops import free_port

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        base_env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect-home"),
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        base_env.pop("PREFECT_API_URL", None)
        port = free_port()
        server = ops.start_server(tmp / "server-state", port=port, timeout=300,
                                  extra_env={"PREFECT_HOME": str(tmp / "server-home")})
        try:
            env = {**base_env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
            cold, out = cli_run(tmp, env, args.overrides)
            print(out)
            rerun, out = cli_run(tmp, env, args.overrides)
            print(out)
            cached = sum(1 for line in out.splitlines() if " Cached " in f" {line} ")
        finally:
            server.stop()
        temp_server, _ = cli_run(tmp, base_env, args.overrides)
    print(f"cold lifecycle (running Prefect server):     {cold:7.1f} s")
    print(f"no-change rerun (running Prefect server):    {rerun:7.1f} s  ({cached} stages Cached)")
    print(f"no-change rerun (temporary Prefect server):  {temp_server:7.1f} s")
    print(f"rerun / cold = {rerun / cold:.3f} (goal < 0.05), rerun = {rerun:.1f} s (goal < 10 s)")
    print(f"RESULT rerun_over_cold {rerun / cold:.4f} goal < 0.05")


if __name__ == "__main__":
    main()
