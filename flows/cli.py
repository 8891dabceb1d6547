"""The ``llmpipe`` command: run the DAG, inspect the store, operate Prefect and Triton.

Exit codes: 0 ok, 2 bad config or usage, or a selected stage's pip extra not installed (nothing ran),
1 a stage failed (the message names it).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from llmpipe.config import ConfigError, PipelineConfig, load_config
from llmpipe.pipeline import MissingExtra
from llmpipe.sources import SourceError

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_INTERRUPTED = 0, 1, 2, 130
FLOW_NAMES = ("lifecycle", "data_refresh", "pretrain", "post_train", "release")


def _load(args: argparse.Namespace) -> PipelineConfig:
    return load_config(args.config, args.overrides)


def flow_function(name: str) -> Any:
    """The flow object (one of ``FLOW_NAMES``), importing only its module."""
    import importlib

    return getattr(importlib.import_module(f"flows.{name}"), name)


def ensure_state_dirs(state_dir: str | Path) -> Path:
    """Create the project's state folder and Prefect's home, with parents, before Prefect is imported.

    Prefect creates ``PREFECT_HOME`` with ``mkdir(exist_ok=True)`` and no parents: in a fresh folder
    without ``.llmpipe/`` it cannot, and its temporary server then fails to open its database. An
    explicit ``PREFECT_HOME`` is created the same way. Returns Prefect's home.
    """
    import os

    home = Path(os.environ.get("PREFECT_HOME") or Path(state_dir).resolve() / "prefect").expanduser()
    home.mkdir(parents=True, exist_ok=True)
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    return home


def use_project_prefect(state_dir: str | Path) -> bool:
    """Keep Prefect's state with the project, and use the server ``llmpipe server`` started if it is up.

    Without this every run would share ``~/.prefect`` (and its SQLite lock) with unrelated projects.
    An explicit ``PREFECT_API_URL`` or ``PREFECT_HOME`` always wins. Returns whether a server is known
    (False: Prefect starts a temporary one for this run).
    """
    import os
    import urllib.request

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # a cold temporary server migrates its SQLite database first: slow machines need more than 20 s
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_HOME", str(ensure_state_dirs(state_dir)))
    if os.environ.get("PREFECT_API_URL"):
        return True
    info = Path(os.environ["PREFECT_HOME"]) / "server.json"
    if info.is_file():
        try:
            url = json.loads(info.read_text())["api_url"].rstrip("/")
            with urllib.request.urlopen(f"{url}/health", timeout=1):
                os.environ["PREFECT_API_URL"] = url
                return True
        except (OSError, ValueError, KeyError):
            pass  # not running: Prefect starts a temporary local server for this run
    return False


def _preflight(cfg: PipelineConfig, args: argparse.Namespace) -> None:
    """Everything that can be checked from the config and the file system, before Prefect starts."""
    from llmpipe.dag import check_extras, check_stage_range
    from llmpipe.sources import check_sources

    check_stage_range(args.from_stage, args.until)  # unknown --from/--until: exit 2
    check_extras(cfg, args.flow, args.from_stage, args.until)  # a selected stage's pip extra missing: exit 2
    check_sources(cfg)  # no sources, a missing path, an unreadable format: exit 2


def cmd_run(args: argparse.Namespace) -> int:
    from llmpipe import console as console_mod
    from llmpipe.dag import state_dir

    cfg = _load(args)  # bad config: exit 2 before any work
    if args.sample is not None:  # a smoke run: a fraction of each source, in a store of its own
        from llmpipe.smoke import sample_overrides

        args.overrides = [*args.overrides, *sample_overrides(cfg.store, args.sample)]
        cfg = _load(args)
    _preflight(cfg, args)
    console = console_mod.RunConsole.for_run(state_dir(cfg), args.flow, verbose=args.verbose or not args.process)
    console.open()
    _configure_logging(args.verbose)
    console.say(f"llmpipe run {args.config}: {args.flow}; logs in {_shown(console.log_dir)}/")
    if args.no_prefect:
        from llmpipe.dag import run_pipeline

        rows = [{"stage": r.stage, "key": r.key[:12], "status": "ran" if r.ran else "cached",
                 "seconds": round(r.seconds, 2)} for r in run_pipeline(cfg, args.flow, args.from_stage, args.until)]
    else:
        if not use_project_prefect(cfg.state_dir):
            from llmpipe.processes import guard

            guard()  # Prefect's temporary server is a child of this process: it ends with the run, killed or not
            console.say("Prefect: no `llmpipe server` for this project, starting a temporary server for this "
                        "run (15-30 s); `llmpipe server` keeps one up, with the UI")
        rows = flow_function(args.flow)(config=args.config, overrides=args.overrides,
                                        from_stage=args.from_stage, until=args.until)
    _print_table(rows, ("stage", "key", "status", "state", "seconds", "counts"), out=console.say)
    if args.sample is not None:
        for line in _full_run_estimate(cfg, [r["stage"] for r in rows]):
            console.say(line)
    return EXIT_OK


def _full_run_estimate(cfg: PipelineConfig, stages: list[str]) -> list[str]:
    """What the full run needs, scaled up from the smoke run's stats (see ``llmpipe.smoke``)."""
    from llmpipe.dag import open_store, plan
    from llmpipe.smoke import full_run_estimate

    planned, store = plan(cfg), open_store(cfg)
    stats = {name: art.stats for name in stages if (art := store.get(name, planned[name].key, verify=False))}
    return full_run_estimate(cfg.ingest.sample, stats, cfg.train.global_batch_size, cfg.tokenize.seq_len,
                             cfg.train.max_steps)


def _fraction(text: str) -> float:
    from llmpipe.smoke import check_fraction

    try:
        return check_fraction(float(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e) if "between" in str(e) else f"not a number: {text!r}") from None


def _shown(path: Path) -> str:
    """``path`` relative to the working folder where it is inside it (shorter, and what the user typed)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def cmd_lr_find(args: argparse.Namespace) -> int:
    """Sweep the learning rate on the config's model and data; write the curve; suggest an lr."""
    from llmpipe.dag import MissingInput, open_store, plan, state_dir
    from llmpipe.tokenization.layout import TOKENIZE
    from llmpipe.training.lr_finder import find, plot
    from llmpipe.training.stage import resolve_deepspeed, vocab_size_of

    cfg = _load(args)
    planned, store = plan(cfg), open_store(cfg)
    arts = {name: store.get(name, planned[name].key) for name in ("tokenize", "tokenizer")}
    for name, art in arts.items():
        if art is None:
            raise MissingInput(f"lr-find needs the {name} artifact of this config; run "
                               f"`llmpipe run {args.config} --until tokenize` first")
    # the same sweep as train.lr_find in the pretrain stage: one process, train.lr_find's settings
    # unless the flags say otherwise
    train = resolve_deepspeed(cfg.train, cfg.base_dir())
    data = Path(arts["tokenize"].path)
    seq_len = train.seq_len or json.loads((data / TOKENIZE.index).read_text())["seq_len"]
    out = state_dir(cfg) / "lr-find" / planned["pretrain"].key[:12]
    out.mkdir(parents=True, exist_ok=True)
    result = find(train, data, seq_len, vocab_size_of(Path(arts["tokenizer"].path)), out, min_lr=args.min_lr,
                  max_lr=args.max_lr, steps=args.steps)
    (out / "lr_find.json").write_text(result.to_json())
    plot(result, out / "lr_find.png")
    print(f"suggested learning rate: {result.suggested_lr:.3g} ({result.rule}; {len(result.lrs)} steps from "
          f"{result.lrs[0]:.2g} to {result.lrs[-1]:.2g})")
    print(f"curve: {_shown(out / 'lr_find.png')}; to use it: train.optimizer.lr={result.suggested_lr:.3g}")
    if use_project_prefect(cfg.state_dir):  # the project's Prefect server is up: show it in the UI
        from flows.common import publish_lr_find

        publish_lr_find(result, out / "lr_find.png")
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    from llmpipe.dag import open_store, plan

    cfg = _load(args)
    store = open_store(cfg)
    rows = []
    for name, ps in plan(cfg).items():
        art = store.get(name, ps.key)
        size = sum(f["bytes"] for f in art.manifest["files"].values()) if art else 0
        rows.append({"stage": name, "flow": ps.spec.flow, "key": ps.key[:12],
                     "status": "cached" if art else "missing", "size": _human(size) if art else "-",
                     "model": ps.model_from or "-"})  # the model a `model` input reads (tuned or pretrain)
    _print_table(rows, ("stage", "flow", "key", "status", "size", "model"))
    return EXIT_OK


def cmd_stages(args: argparse.Namespace) -> int:
    from llmpipe.pipeline import load_stages

    rows = [{"stage": s.name, "flow": s.flow, "inputs": ",".join(s.inputs) or "(sources)",
             "config": s.config_field or "-", "version": s.version, "what": s.description}
            for s in load_stages().values()]
    _print_table(rows, ("stage", "flow", "inputs", "config", "version", "what"))
    return EXIT_OK


def _store_from(args: argparse.Namespace) -> Any:
    from llmpipe.dag import open_store

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
    print(f"{len(doomed)} artifacts and per-shard results, {_human(total)}{'' if args.yes else ' (dry run: pass --yes to delete)'}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    """Write a document stage's documents of the config's current plan to a folder (llmpipe.export)."""
    from llmpipe.export import ExportError, check_stage, export_stage

    try:
        check_stage(args.stage)  # a non-document stage: exit 2 before hashing any source
        cfg = _load(args)
        ref = " ".join([args.config, *args.overrides])
        r = export_stage(cfg, args.stage, args.to, args.format, args.rejected, config_ref=ref)
    except ExportError as e:
        print(f"llmpipe export: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print("\n".join(r.summary()))
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    if args.config and Path(args.config).is_file():
        ensure_state_dirs(load_config(args.config).state_dir)
    from llmpipe.serving.server import main_serve

    monitor_dir = Path(__file__).resolve().parent.parent / "deployments" / "monitoring" if args.monitor else None
    import os

    api_key = args.api_key or os.environ.get("LLMPIPE_API_KEY") or None
    if args.triton:  # the front end only, in front of a Triton already running there
        from llmpipe.serving.server import main_api

        if args.no_api or args.monitor or args.engine == "vllm":
            print("llmpipe serve: --triton serves the API only (no --no-api, --monitor or --engine vllm)",
                  file=sys.stderr)
            return EXIT_CONFIG
        return int(main_api(args.artifact, args.triton, config=args.config, api_port=args.api_port,
                            api_host=args.api_host, api_key=api_key) or 0)
    engine = args.engine
    if engine is None:  # what the deploy stage recorded (deploy.engine) and checked the artifact with
        from llmpipe.serving.server import deployed_engine, resolve_artifact

        try:
            engine = deployed_engine(resolve_artifact(args.artifact, args.config))
        except (FileNotFoundError, ValueError) as e:
            print(f"llmpipe serve: {e}", file=sys.stderr)
            return EXIT_CONFIG
        print(f"llmpipe serve: engine {engine} (the artifact's deploy.engine; --engine overrides)", flush=True)
    if engine == "vllm":
        from llmpipe.serving.server import main_serve_vllm

        if args.no_api or args.monitor:
            print("llmpipe serve: --engine vllm serves vLLM's own OpenAI API only (no --no-api, no --monitor)",
                  file=sys.stderr)
            return EXIT_CONFIG
        return int(main_serve_vllm(args.artifact, config=args.config, api_port=args.api_port,
                                   api_host=args.api_host, api_key=api_key, enforce_eager=args.enforce_eager) or 0)
    if args.enforce_eager:
        print("llmpipe serve: --enforce-eager is vLLM's flag (with --engine vllm)", file=sys.stderr)
        return EXIT_CONFIG
    return int(main_serve(args.artifact, config=args.config, http_port=args.http_port,
                          grpc_port=args.grpc_port, metrics_port=args.metrics_port, monitor_dir=monitor_dir,
                          prometheus_port=args.prometheus_port, alertmanager_port=args.alertmanager_port,
                          api_port=None if args.no_api else args.api_port, api_host=args.api_host,
                          api_key=api_key) or 0)


def cmd_server(args: argparse.Namespace) -> int:
    ensure_state_dirs(args.state_dir)
    from flows import prefect_ops

    return int(prefect_ops.server(state_dir=args.state_dir, port=args.port) or 0)


def cmd_worker(args: argparse.Namespace) -> int:
    ensure_state_dirs(args.state_dir)
    from flows import prefect_ops

    return int(prefect_ops.worker(args.pool, state_dir=args.state_dir) or 0)


def cmd_deploy(args: argparse.Namespace) -> int:
    ensure_state_dirs(args.state_dir)
    from flows import prefect_ops

    result = prefect_ops.deploy(state_dir=args.state_dir, timezone=args.timezone)
    if result is not None:
        print(json.dumps(result, indent=1, default=str) if not isinstance(result, str) else result)
    return EXIT_OK


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def _print_table(rows: list[dict[str, Any]], cols: tuple[str, ...], out: Any = print) -> None:
    cols = tuple(c for c in cols if any(c in r for r in rows))
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols} if rows else {}
    out("  ".join(c.ljust(widths[c]) for c in cols).rstrip())
    for r in rows:
        out("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols).rstrip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmpipe", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run the DAG (or one flow) for a config, reusing cached stages")
    r.add_argument("config")
    r.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.optimizer.lr=3e-4")
    r.add_argument("--flow", choices=FLOW_NAMES, default="lifecycle")
    r.add_argument("--from", dest="from_stage", metavar="STAGE")
    r.add_argument("--until", metavar="STAGE")
    r.add_argument("--no-prefect", action="store_true", help="run in-process without Prefect (debugging)")
    r.add_argument("--sample", type=_fraction, metavar="FRACTION",
                   help="smoke run: the same FRACTION of each source every time (by document hash), in a "
                        "store of its own (<store>-sample-FRACTION); prints what the full run needs")
    r.add_argument("-v", "--verbose", action="store_true",
                   help="show every log line, warning and third-party message in the terminal too")
    r.set_defaults(func=cmd_run)

    lf = sub.add_parser("lr-find", help="sweep the learning rate on the config's model and data, suggest one")
    lf.add_argument("config")
    lf.add_argument("overrides", nargs="*")
    lf.add_argument("--steps", type=int, default=None, help="sweep length (default: train.lr_find.steps, 100)")
    lf.add_argument("--min-lr", type=float, default=None,
                    help="first learning rate (default: train.lr_find.min_lr, 1e-05)")
    lf.add_argument("--max-lr", type=float, default=None, help="last learning rate (default: train.lr_find.max_lr, 1)")
    lf.set_defaults(func=cmd_lr_find)

    s = sub.add_parser("status", help="each stage of a config: cached or not, key, size")
    s.add_argument("config")
    s.add_argument("overrides", nargs="*")
    s.set_defaults(func=cmd_status)

    sub.add_parser("stages", help="the registered stages in DAG order").set_defaults(func=cmd_stages)

    for name, fn, hlp in (("lineage", cmd_lineage, "the chain from an artifact back to the raw sources"),
                          ("gc", cmd_gc, "remove artifacts and per-shard results that no recorded run reaches")):
        g = sub.add_parser(name, help=hlp)
        if name == "lineage":
            g.add_argument("target", metavar="KEY_OR_PATH")
        g.add_argument("--config", help="config whose store to use")
        g.add_argument("--store", default=".llmpipe/store", help="store root when no --config (default %(default)s)")
        if name == "gc":
            g.add_argument("--yes", action="store_true", help="really delete (default: dry run)")
        g.set_defaults(func=fn)

    ex = sub.add_parser("export", help="write a document stage's kept (and rejected) documents to a folder")
    ex.add_argument("stage", help="ingest, langid, quality, coherence, expertise, safety, entities, dedup, diversity, timeliness or augment")
    ex.add_argument("config")
    ex.add_argument("overrides", nargs="*")
    ex.add_argument("--to", required=True, metavar="DIR", help="folder to write kept/, rejected/ and export.json")
    ex.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    ex.add_argument("--rejected", action="store_true", help="also the rejected documents, with reasons and scores")
    ex.set_defaults(func=cmd_export)

    sv = sub.add_parser("serve", help="start a local Triton server on a deploy artifact and wait")
    sv.add_argument("artifact", nargs="?", help="deploy artifact path or key (default: the config's latest)")
    sv.add_argument("--config", default="configs/tiny.yaml")
    sv.add_argument("--http-port", type=int, default=8000)
    sv.add_argument("--grpc-port", type=int, default=8001)
    sv.add_argument("--metrics-port", type=int, default=8002)
    sv.add_argument("--monitor", action="store_true", help="also Prometheus and Alertmanager with the rules of "
                    "deployments/monitoring; alerts print here")
    sv.add_argument("--prometheus-port", type=int, default=9090)
    sv.add_argument("--alertmanager-port", type=int, default=9093)
    sv.add_argument("--api-port", type=int, default=8080, help="the OpenAI-compatible API's port (/v1/completions, "
                    "/v1/chat/completions, /v1/models); 0 picks a free one")
    sv.add_argument("--api-host", default="127.0.0.1", help="the API's address (default: loopback only)")
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (default: "
                    "$LLMPIPE_API_KEY, else none)")
    sv.add_argument("--no-api", action="store_true", help="serve Triton's own endpoints only, without the API")
    sv.add_argument("--triton", metavar="HOST:PORT", default=None, help="start no Triton: serve only the API, in "
                    "front of the Triton whose gRPC port this is (compose's api-N beside triton-N)")
    sv.add_argument("--engine", choices=("llmpipe", "triton", "vllm"), default=None, help="default: the engine the "
                    "artifact's deploy.json records (deploy.engine). llmpipe (or triton): Triton with our "
                    "model and the API in front of it; vllm: vLLM's own OpenAI server on the deployed checkpoint "
                    "(its CPU build from .venv-vllm, which `make test` builds, or LLMPIPE_VLLM_PYTHON)")
    sv.add_argument("--enforce-eager", action="store_true", help="with --engine vllm: vLLM's --enforce-eager (no "
                    "torch.compile at start-up: 25-70 s less of a start of its CPU build on 2 cores; the same "
                    "tokens, uncompiled decode)")
    sv.set_defaults(func=cmd_serve)

    se = sub.add_parser("server", help="start a local Prefect server (UI) with state under the state dir")
    se.add_argument("--state-dir", default=".llmpipe")
    se.add_argument("--port", type=int, default=4200)
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


def _configure_logging(verbose: bool = True) -> None:
    """INFO to stderr: the terminal with ``-v`` or outside ``run``, the run's log file otherwise."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def entry() -> int:
    """The console script: ``main`` as the process itself, which may take over its file descriptors."""
    return main(process=True)


def main(argv: list[str] | None = None, process: bool = False) -> int:
    """The command. ``process``: this is the ``llmpipe`` process itself (the console script), so
    ``run`` may point file descriptors 1 and 2 at its log files; an in-process caller keeps its own."""
    _configure_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.process = process
    if extra:  # overrides may come after options: `run CONFIG --until dedup train.max_steps=100`
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except ConfigError as e:
        _report(f"llmpipe: bad config:\n{e}")
        return EXIT_CONFIG
    except SourceError as e:
        _report(f"llmpipe: bad source: {args.__dict__.get('config', '')}: {e}")
        return EXIT_CONFIG
    except MissingExtra as e:
        _report(f"llmpipe: {e}")
        return EXIT_CONFIG
    except ValueError as e:
        if "unknown stage" in str(e) or "no such" in str(e):
            _report(f"llmpipe: {e}")
            return EXIT_CONFIG
        _report(_failure(e))
        return EXIT_FAILED
    except Exception as e:  # noqa: BLE001 - the command line reports, it does not trace back
        _report(_failure(e))
        return EXIT_FAILED
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM/SIGHUP where a command turns them into it
        _report("llmpipe: interrupted")
        return EXIT_INTERRUPTED
    finally:
        from llmpipe import console

        if console.active() is not None:
            console.active().close(restore=not process)


def _failure(e: BaseException) -> str:
    """One line for a failed run: the stage and its error (not Prefect's wrappers), and the stage's log."""
    from llmpipe import console
    from llmpipe.dag import MissingInput, StageFailed

    err: BaseException | None = e
    while err is not None and not isinstance(err, (StageFailed, MissingInput)):
        err = err.__cause__ or err.__context__
    message = f"llmpipe: {err if err is not None else f'{type(e).__name__}: {e}'}"
    run = console.active()
    if run is not None:
        stage = getattr(err, "stage", None) or run.current_stage
        log = run.stage_log(stage) if stage and run.stage_log(stage).exists() else run.log_dir / console.RUN_LOG
        message += f"\n  log: {_shown(log)}"
    return message


def _report(message: str) -> None:
    """An error goes to the terminal, also when a run's output goes to its log files."""
    from llmpipe import console

    run = console.active()
    if run is not None:
        print(message, file=sys.stderr)  # the log file keeps it too
        run.error(message)
    else:
        print(message, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(entry())
