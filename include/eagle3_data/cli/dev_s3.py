"""`eagle3-data dev s3 start|stop|status`: the embedded S3 (SeaweedFS) for demos and tests."""

from __future__ import annotations

import argparse


def register(dev_sub: argparse._SubParsersAction) -> None:
    p = dev_sub.add_parser("s3", help="embedded S3 server (SeaweedFS) on 127.0.0.1")
    sub = p.add_subparsers(dest="s3_command", required=True)
    start = sub.add_parser(
        "start",
        help="start in the background (keys: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, else dev defaults)",
    )
    start.add_argument("--dir", required=True, help="data, pid file and log live here (kept across restarts)")
    start.add_argument("--port", type=int, default=None, help="S3 port (default: a free one, or the last one used)")
    start.set_defaults(func=_start)
    stop = sub.add_parser("stop", help="stop the server of DIR by its PID")
    stop.add_argument("--dir", required=True)
    stop.set_defaults(func=_stop)
    status = sub.add_parser("status", help="print the endpoint of DIR's server, exit 1 when none runs")
    status.add_argument("--dir", required=True)
    status.set_defaults(func=_status)


def _start(args: argparse.Namespace) -> int:
    from eagle3_data.dev.seaweedfs import start_seaweedfs

    handle = start_seaweedfs(args.dir, port=args.port)
    _print(handle)
    return 0


def _stop(args: argparse.Namespace) -> int:
    from eagle3_data.dev.seaweedfs import stop_seaweedfs

    print("stopped" if stop_seaweedfs(args.dir) else "not running")
    return 0


def _status(args: argparse.Namespace) -> int:
    from eagle3_data.dev.seaweedfs import running_handle

    handle = running_handle(args.dir)
    if handle is None:
        print("not running")
        return 1
    _print(handle)
    return 0


def _print(handle) -> None:
    """How a client connects. The secret is printed only when it is the dev server's documented
    default (`eagle3_data.dev.seaweedfs.DEV_SECRET_KEY`, nothing secret about it); one taken from
    AWS_SECRET_ACCESS_KEY stays out of the output: whoever set it knows it."""
    from eagle3_data.dev.seaweedfs import DEV_SECRET_KEY

    print(f"endpoint_url={handle.endpoint_url}")
    print(f"access_key={handle.access_key}")
    if handle.secret_key == DEV_SECRET_KEY:
        print(f"secret_key={handle.secret_key}")
    else:
        print("secret_key=from:AWS_SECRET_ACCESS_KEY")  # the environment that started it holds it
    print(f"pid={handle.pid}")
