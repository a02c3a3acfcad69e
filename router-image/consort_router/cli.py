"""`consort router --config FILE --port P`: flags, the Router built and served until a signal."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from aiohttp import web

from consort_common.help import HelpFormatter

from .breaker import BreakerStore
from .config import RouterConfig
from .router import DRAIN_S, Router
from .server import build_app

log = logging.getLogger("consort.router")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="consort router", description="Run the ensemble router.",
                                formatter_class=HelpFormatter)
    p.add_argument("--config", required=True, metavar="FILE", help="RouterConfig YAML/JSON (reloaded when it changes)")
    p.add_argument("--port", type=int, required=True, help="port (0 = any free port, printed at start)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 in a pod)")
    p.add_argument("--access-log", action="store_true", help="log one line per HTTP request")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace, store: BreakerStore | None = None) -> int:
    """Run until SIGINT/SIGTERM. `store` replaces the config's breaker store (e.g. EnsembleRouter status)."""
    config = RouterConfig.load(args.config)
    router = Router(config, config_path=args.config, store=store)
    app = build_app(router)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=log if args.access_log else None,
                           shutdown_timeout=DRAIN_S)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
    except OSError:   # port in use: close the upstream session first, so the cause stays the last line
        await runner.cleanup()
        raise
    port = runner.addresses[0][1] if runner.addresses else args.port
    print(f"consort router: ensemble {config.ensemble!r}, {len(config.specialists)} specialists; listening on "
          f"http://{args.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("consort router: shutting down", flush=True)
    await runner.cleanup()
    close = getattr(router.lanes.store, "close", None)   # stores that write in the background: flush, close
    if close is not None:
        close()
    return 0


def main(argv: list[str] | None = None, store: BreakerStore | None = None) -> int:
    """`consort router`. The breaker store: `store` when given (tests), else the EnsembleRouter's status
    when CONSORT_ENSEMBLE_ROUTER names one (router pods: kube_store.py), else the config's."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if store is None:
        from .kube_store import store_from_env

        try:
            store = store_from_env()
        except ValueError as e:
            print(f"consort router: fatal: {e}", file=sys.stderr, flush=True)
            return 2
        if store is not None:
            print(f"consort router: breaker state in {store.url}", flush=True)
    try:
        return asyncio.run(serve(args, store=store))
    except Exception as exc:  # noqa: BLE001 - any escape from serve() is fatal
        # Bad config, unreadable file, port in use, ...: exit non-zero at once with the cause as the
        # last line, so a supervisor (`consort up`, kubelet) shows why instead of a traceback.
        log.debug("start-up failed", exc_info=True)
        print(f"consort router: fatal: {one_line(exc, args.config)}", file=sys.stderr, flush=True)
        return 2 if isinstance(exc, ValueError) else 1


def one_line(exc: BaseException, config_path: str) -> str:
    """A start-up exception as one line: a config that fails validation as `PATH: loc: msg; ...`."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return f"invalid config {config_path}: " + "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '(top level)'}: {e['msg']}" for e in exc.errors())
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
