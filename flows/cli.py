"""The ``llmpipe`` command: run the DAG, inspect the store, operate Prefect and Triton.

Exit codes: 0 ok, 2 bad config or usage (nothing ran), 1 a stage failed (the message names it).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from llmpipe.config import ConfigError, PipelineConfig, load_config
from llmpipe.sources import SourceError

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
FLOW_NAMES = ("lifecycle", "data_refresh", "pretrain", "release")


def _load(args: argparse.Namespace) -> PipelineConfig:
    return load_config(args.config, args.overrides)


def flow_function(name: str) -> Any:
    """The flow object (one of ``FLOW_NAMES``), importing only its module."""
    import importlib

    return getattr(importlib.import_module(f"flows.{name}"), name)


def use_project_prefect(state_dir: str | Path) -> None:
    """Keep Prefect's state with the project, and use the server ``llmpipe server`` started if it is up.

    Without this every run would share ``~/.prefect`` (and its SQLite lock) with unrelated projects.
    An explicit ``PREFECT_API_URL`` or ``PREFECT_HOME`` always wins.
    """
    import os
    import urllib.request

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # a cold temporary server migrates its SQLite database first: slow machines need more than 20 s
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    if os.environ.get("PREFECT_API_URL"):
        return
    home = Path(state_dir).resolve() / "prefect"
    os.environ.setdefault("PREFECT_HOME", str(home))
    info = Path(os.environ["PREFECT_HOME"]) / "server.json"
    if info.is_file():
        try:
            url = json.loads(info.read_text())["api_url"].rstrip("/")
            with urllib.request.urlopen(f"{url}/health", timeout=1):
                os.environ["PREFECT_API_URL"] = url
                return
        except (OSError, ValueError, KeyError):
            pass  # not running: Prefect starts a temporary local server for this run
    logging.getLogger("llmpipe").info(
        "no `llmpipe server` is running for this project: unless your Prefect profile names an API URL, "
        "Prefect starts a temporary server for this run (15-30 s on 2 cores); `llmpipe server` keeps one "
        "up, with the UI, and runs then start in a few seconds")


def run_flow_in_process(flow: Any, **params: Any) -> Any:
    """Call ``flow`` here, with its heartbeats emitted by ``flows.common`` instead of Prefect's engine.

    Same events at the same interval (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``), but the engine's
    heartbeat thread sleeps in one-second steps and is joined when the run ends: 0.5 s on average
    of every run. Turned off when that setting is off.
    """
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, get_current_settings, temporary_settings

    from flows import common

    seconds = get_current_settings().flows.heartbeat_frequency
    if seconds is None:
        return flow(**params)
    common.HEARTBEAT_SECONDS = seconds
    try:
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            return flow(**params)
    finally:
        common.HEARTBEAT_SECONDS = None


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _load(args)  # bad config: exit 2 before any work
    use_project_prefect(cfg.state_dir)
    from llmpipe.runner import check_stage_range

    check_stage_range(args.from_stage, args.until)  # unknown --from/--until: exit 2
    if not args.no_prefect and args.warm:
        from flows import warm

        code = warm.run_in_warm_runner(args.argv)  # None: no warm runner to use, run it here
        if code is not None:
            return code
    if args.no_prefect:
        from llmpipe.runner import run_pipeline

        rows = [{"stage": r.stage, "key": r.key[:12], "status": "ran" if r.ran else "cached",
                 "seconds": round(r.seconds, 2)} for r in run_pipeline(cfg, args.flow, args.from_stage, args.until)]
    else:
        from llmpipe.stage import gc_paused

        # importing Prefect creates ~110,000 tracked objects that live as long as the process: the
        # collector's passes over them cost 0.1-0.4 CPU-s of each run and free nothing
        with gc_paused():
            flow = flow_function(args.flow)
        rows = run_flow_in_process(flow, config=args.config, overrides=args.overrides,
                                   from_stage=args.from_stage, until=args.until)
    _print_table(rows, ("stage", "key", "status", "state", "seconds", "counts"))
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    from llmpipe.runner import open_store, plan

    cfg = _load(args)
    store = open_store(cfg)
    rows = []
    for name, ps in plan(cfg).items():
        art = store.get(name, ps.key)
        size = sum(f["bytes"] for f in art.manifest["files"].values()) if art else 0
        rows.append({"stage": name, "flow": ps.spec.flow, "key": ps.key[:12],
                     "status": "cached" if art else "missing", "size": _human(size) if art else "-"})
    _print_table(rows, ("stage", "flow", "key", "status", "size"))
    return EXIT_OK


def cmd_stages(args: argparse.Namespace) -> int:
    from llmpipe.pipeline import load_stages

    rows = [{"stage": s.name, "flow": s.flow, "inputs": ",".join(s.inputs) or "(sources)",
             "config": s.config_field or "-", "version": s.version, "what": s.description}
            for s in load_stages().values()]
    _print_table(rows, ("stage", "flow", "inputs", "config", "version", "what"))
    return EXIT_OK


def _store_from(args: argparse.Namespace) -> Any:
    from llmpipe.runner import open_store

    cfg = load_config(args.config, []) if args.config else load_config(None, [f"store={args.store}"])
    return open_store(cfg)


def cmd_lineage(args: argparse.Namespace) -> int:
    store = _store_from(args)
    found = store.find(args.target)
    if found is None:
        print(f"llmpipe lineage: no single artifact matches {args.target!r} in {store.url}", file=sys.stderr)
        return EXIT_CONFIG
    for node in store.lineage(*found):
        pad = "  " * node["depth"]
        if node.get("source"):
            print(f"{pad}└─ {node['stage']}  content {node['key'][:16]}")
        elif node.get("missing"):
            print(f"{pad}└─ {node['stage']} {node['key'][:12]}  (missing from the store)")
        else:
            print(f"{pad}{'└─ ' if node['depth'] else ''}{node['stage']} {node['key'][:12]}  {node['created']}")
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    store = _store_from(args)
    doomed = store.gc(dry_run=not args.yes)
    total = sum(b for _, b in doomed)
    for path, size in doomed:
        print(f"{'removed' if args.yes else 'would remove'}  {_human(size):>9}  {path}")
    print(f"{len(doomed)} artifacts, {_human(total)}{'' if args.yes else ' (dry run: pass --yes to delete)'}")
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    from llmpipe.serving.server import main_serve

    return int(main_serve(args.artifact, config=args.config, http_port=args.http_port,
                          grpc_port=args.grpc_port) or 0)


def cmd_server(args: argparse.Namespace) -> int:
    from flows import ops

    return int(ops.server(state_dir=args.state_dir, port=args.port, warm=args.warm) or 0)


def cmd_worker(args: argparse.Namespace) -> int:
    from flows import ops

    return int(ops.worker(args.pool, state_dir=args.state_dir) or 0)


def cmd_deploy(args: argparse.Namespace) -> int:
    from flows import ops

    result = ops.deploy(state_dir=args.state_dir, timezone=args.timezone)
    if result is not None:
        print(json.dumps(result, indent=1, default=str) if not isinstance(result, str) else result)
    return EXIT_OK


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def _print_table(rows: list[dict[str, Any]], cols: tuple[str, ...]) -> None:
    cols = tuple(c for c in cols if any(c in r for r in rows))
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols} if rows else {}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmpipe", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run the DAG (or one flow) for a config, reusing cached stages")
    r.add_argument("config")
    r.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.lr=3e-4")
    r.add_argument("--flow", choices=FLOW_NAMES, default="lifecycle")
    r.add_argument("--from", dest="from_stage", metavar="STAGE")
    r.add_argument("--until", metavar="STAGE")
    r.add_argument("--no-prefect", action="store_true", help="run in-process without Prefect (debugging)")
    r.add_argument("--no-warm", dest="warm", action="store_false",
                   help="run in this process even when `llmpipe server`'s warm runner is up (also LLMPIPE_WARM=0)")
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("status", help="each stage of a config: cached or not, key, size")
    s.add_argument("config")
    s.add_argument("overrides", nargs="*")
    s.set_defaults(func=cmd_status)

    sub.add_parser("stages", help="the registered stages in DAG order").set_defaults(func=cmd_stages)

    for name, fn, hlp in (("lineage", cmd_lineage, "the chain from an artifact back to the raw sources"),
                          ("gc", cmd_gc, "remove artifacts that no recorded run reaches")):
        g = sub.add_parser(name, help=hlp)
        if name == "lineage":
            g.add_argument("target", metavar="KEY_OR_PATH")
        g.add_argument("--config", help="config whose store to use")
        g.add_argument("--store", default=".llmpipe/store", help="store root when no --config (default %(default)s)")
        if name == "gc":
            g.add_argument("--yes", action="store_true", help="really delete (default: dry run)")
        g.set_defaults(func=fn)

    sv = sub.add_parser("serve", help="start a local Triton server on a deploy artifact and wait")
    sv.add_argument("artifact", nargs="?", help="deploy artifact path or key (default: the config's latest)")
    sv.add_argument("--config", default="configs/tiny.yaml")
    sv.add_argument("--http-port", type=int, default=8000)
    sv.add_argument("--grpc-port", type=int, default=8001)
    sv.set_defaults(func=cmd_serve)

    se = sub.add_parser("server", help="start a local Prefect server (UI) with state under the state dir")
    se.add_argument("--state-dir", default=".llmpipe")
    se.add_argument("--port", type=int, default=4200)
    se.add_argument("--no-warm", dest="warm", action="store_false",
                    help="do not start the warm runner that `llmpipe run` hands its runs to")
    se.set_defaults(func=cmd_server)

    w = sub.add_parser("worker", help="start a Prefect process worker for the deployments")
    w.add_argument("--pool", default="llmpipe-process")
    w.add_argument("--state-dir", default=".llmpipe")
    w.set_defaults(func=cmd_worker)

    d = sub.add_parser("deploy", help="register the deployments of deployments/prefect.yaml")
    d.add_argument("--state-dir", default=".llmpipe")
    d.add_argument("--timezone", default=None, help="timezone of the nightly schedule (default UTC)")
    d.set_defaults(func=cmd_deploy)
    return p


def _fast_exit() -> None:
    """Skip the garbage collector's passes over every object at interpreter exit.

    Prefect and pydantic leave hundreds of thousands of objects behind; the collections Python runs
    while tearing the interpreter down cost about half a second of a no-change rerun, to reclaim
    memory the process is about to return anyway. Registered first, so it runs after every other
    exit handler (Prefect's log and event flushes included); reference counting still frees
    objects, closes files and runs finalizers as usual.
    """
    import atexit
    import gc

    atexit.unregister(gc.freeze)  # once, however often main() runs in one process (tests)
    atexit.register(gc.freeze)


def prepare_process() -> None:
    """Exit handling and logging of an ``llmpipe`` process (the warm runner does it before its imports)."""
    _fast_exit()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: list[str] | None = None, warm: bool = True) -> int:
    """The command. ``warm=False``: never hand ``run`` to the warm runner (the warm runner's own runs)."""
    prepare_process()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = argv
    if hasattr(args, "warm"):
        args.warm = args.warm and warm
    if extra:  # overrides may come after options: `run CONFIG --until dedup train.lr=3e-4`
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"llmpipe: bad config:\n{e}", file=sys.stderr)
        return EXIT_CONFIG
    except SourceError as e:
        print(f"llmpipe: bad source: {args.__dict__.get('config', '')}: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except ValueError as e:
        if "unknown stage" in str(e) or "no such" in str(e):
            print(f"llmpipe: {e}", file=sys.stderr)
            return EXIT_CONFIG
        raise
    except Exception as e:  # noqa: BLE001 - the command line reports, it does not trace back
        from llmpipe.runner import MissingInput, StageFailed

        err: BaseException | None = e
        while err is not None and not isinstance(err, (StageFailed, MissingInput)):
            err = err.__cause__ or err.__context__
        print(f"llmpipe: {err if err is not None else f'{type(e).__name__}: {e}'}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
