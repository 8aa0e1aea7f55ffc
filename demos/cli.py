"""``fedmosaic demo`` and ``python -m demos``: launch the Gradio app against a running fedmosaic server.

Imports only argparse at module level (the ``fedmosaic`` command registers it cheaply); Gradio loads
when the demo starts. Gradio's usage analytics are switched off: nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any


def _arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--api-url", default=os.environ.get("FEDMOSAIC_API_URL", "http://127.0.0.1:8000"),
                   help="the fedmosaic server (default: FEDMOSAIC_API_URL or http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=os.environ.get("FEDMOSAIC_API_KEY"),
                   help="bearer key, when the server has --api-key (default: FEDMOSAIC_API_KEY)")
    p.add_argument("--host", default="127.0.0.1", help="interface the demo listens on")
    p.add_argument("--port", type=int, default=7860, help="demo port (0: any free port)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per API request")
    return p


def add_demo_arguments(sub: Any) -> argparse.ArgumentParser:
    """Register ``fedmosaic demo``."""
    return _arguments(sub.add_parser("demo", help="the Gradio demo app (a client of a running server's API)"))


def run_demo(args: argparse.Namespace) -> int:
    """Launch the app and block until interrupted."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from demos.app import build_app
    from demos.client import ApiClient

    client = ApiClient(args.api_url, args.api_key, timeout=args.timeout)
    app = build_app(client)
    port = args.port or _free_port(args.host)
    app.queue(default_concurrency_limit=8).launch(server_name=args.host, server_port=port, ssr_mode=False,
                                                  show_error=True, footer_links=[])
    return 0


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry of ``python -m demos``."""
    parser = _arguments(argparse.ArgumentParser(prog="python -m demos", description=__doc__.splitlines()[0]))
    try:
        return run_demo(parser.parse_args(argv))
    except KeyboardInterrupt:
        return 130
