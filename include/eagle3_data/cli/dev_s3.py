"""`eagle3-data dev s3 start|stop|status`: the embedded S3 (SeaweedFS) for demos and tests."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eagle3_data.dev.seaweedfs import SeaweedHandle


def register(dev_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = dev_sub.add_parser("s3", help="embedded S3 server (SeaweedFS) on 127.0.0.1")
    sub = p.add_subparsers(dest="s3_command", required=True)
    start = sub.add_parser(
        "start",
        help="start in the background (keys: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, else dev defaults); "
        "prints the `export` lines a client needs",
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


def _print(handle: SeaweedHandle) -> None:
    """How a client connects, as `export` lines a shell runs as they are (`eval "$(eagle3-data
    dev s3 start --dir DIR)"`): the variables boto3, the CLI and the DAG's stand-alone runs read.
    The secret is printed only when it is the dev server's documented default
    (`eagle3_data.dev.seaweedfs.DEV_SECRET_KEY`, nothing secret about it); one taken from
    AWS_SECRET_ACCESS_KEY stays out of the output: the shell that set it has it already."""
    import shlex

    from eagle3_data.dev.seaweedfs import DEV_SECRET_KEY

    print(f"export AWS_ENDPOINT_URL={shlex.quote(handle.endpoint_url)}")
    print(f"export AWS_ACCESS_KEY_ID={shlex.quote(handle.access_key)}")
    if handle.secret_key == DEV_SECRET_KEY:
        print(f"export AWS_SECRET_ACCESS_KEY={shlex.quote(handle.secret_key)}")
    else:
        print("# AWS_SECRET_ACCESS_KEY: the one the server was started with (not printed)")
    print(f"# pid {handle.pid}")
