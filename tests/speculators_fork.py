"""A speculators interpreter that starts warm: `python` for the tests' speculators scripts, each
run in a process forked from one that has already imported speculators.

Importing speculators costs 6-9 CPU s a process (torch, transformers, datasets, and
`speculators.models.dflash`, which calls `torch.compile` at import and so loads torch._inductor),
and the suite starts ~15 such processes: the probe's runs, the trainers' readers and oracles
(`make test`'s row in benchmarks/RESULTS.md). This file is both ends:

- `python speculators_fork.py serve SOCKET OWNER_PID` (in .venv-speculators): imports what the
  scripts import, then forks a child per request; each child runs its script as `__main__` with
  the request's argv, working directory, environment and standard streams (passed as file
  descriptors), and its exit status goes back to the client. The server exits with its owner (the
  pytest process) or on SIGTERM, killing what still runs.
- `python -IS speculators_fork.py SOCKET OWNER_PID SERVER_PYTHON SCRIPT ARGS...` (the shim
  `tests/fixtures/speculators.py` writes, stdlib only): the client, standing in for
  `SERVER_PYTHON SCRIPT ARGS...` (`-c CODE` too). It starts the server on first use (under a file
  lock: several tests and benchmarks may ask at once) and exits as its child did; killed, it takes
  the child with it (the server kills a child whose client has gone), so a caller's timeout works.

The child is the script's process as far as the script can tell, except that its modules were
imported before its environment was set: variables read at import time are the server's
(the first caller's environment; the suite sets none per call). One test keeps a cold interpreter
(tests/trainers/test_training_smoke.py), so the venv's own start stays tested.
"""

from __future__ import annotations

import fcntl
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time

PRELOAD = """
import torch, numpy, datasets, safetensors.torch, transformers
import speculators.train.data, speculators.models.eagle3, speculators.losses, speculators.config
import speculators.proposals.greedy, speculators.train.vocab_mapping, speculators.train.cli
import specforge.core.compact_teacher, hs_connectors.transfer
"""
STARTUP_S = 300  # the server's imports on a loaded 2-core machine take ~10 s


def serve(path: str, owner: int) -> None:
    """Accept requests on `path` until the owner process has gone or SIGTERM; one forked child each.
    Single-threaded on purpose: a fork copies only the calling thread."""
    exec(PRELOAD, {})
    sys.stdout.flush()
    sys.stderr.flush()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path + ".new"):  # left by a server killed while it started
        os.unlink(path + ".new")
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # clients connect only to a server that accepts
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    stopping: list[int] = []
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "signal")
    children: dict[int, socket.socket] = {}
    while not stopping and _alive(owner):
        for key, _ in selector.select(timeout=1.0):
            if key.data == "signal":
                os.read(wake_r, 4096)
            elif key.data == "accept":
                conn, _ = listener.accept()
                pid = _fork_child(conn, listener, selector, wake_r)
                if pid is None:
                    conn.close()
                    continue
                children[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
            else:  # a client's connection readable: it went away (killed), so its child goes too
                selector.unregister(key.fileobj)
                _kill_group(key.data)
        _reap(children, selector)
    for pid in children:
        _kill_group(pid)
    os.unlink(path)
    os._exit(0)  # not the interpreter's teardown of torch and the rest: a second of CPU for nothing


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(children: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    """Send each exited child's wait status to its client and close the connection."""
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            conn = children.pop(pid)
            try:
                selector.unregister(conn)
            except KeyError:  # unregistered when its client went away
                pass
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass
            conn.close()


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise ConnectionError("client went away")
        data += chunk
    return json.loads(data), fds


def _fork_child(
    conn: socket.socket, listener: socket.socket, selector: selectors.BaseSelector, wake_r: int
) -> int | None:
    try:
        request, fds = _receive(conn)
    except (OSError, ConnectionError, ValueError):
        return None
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        try:
            os.setpgid(pid, pid)
        except OSError:  # the child set it first, or has already exited
            pass
        return pid
    os.setpgid(0, 0)  # its own group: killed with whatever it starts
    selector.close()
    listener.close()
    conn.close()
    os.close(signal.set_wakeup_fd(-1))
    os.close(wake_r)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os._exit(_run(request))


def _run(request: dict) -> int:
    """The script as `python SCRIPT ARGS` / `python -c CODE ARGS` would run it, in this child."""
    import runpy
    import threading
    import traceback

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # was this file's folder
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException as error:  # printed as the interpreter would: from the script's frames on
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
            tb = tb.tb_next
        traceback.print_exception(type(error), error, tb)
        code = 1
    threading._shutdown()  # as the interpreter's own exit: wait for non-daemon threads
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def connect(path: str, owner: int, server_python: str) -> socket.socket:
    """A connection to the server on `path`, started first when none answers there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        return sock
    except (FileNotFoundError, ConnectionRefusedError):
        pass
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        if os.path.exists(path):  # a server that died (killed with a process group): start another
            os.unlink(path)
        if not os.path.exists(server_python):
            sys.exit(f"no speculators interpreter at {server_python} (`make speculators-venv` builds it)")
        with open(path + ".log", "ab") as log:  # the server holds its own copy of the descriptor
            server = subprocess.Popen(
                [server_python, os.path.abspath(__file__), "serve", path, str(owner)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                process_group=0,  # outlives the caller's group; same session (and scheduling group)
            )
        deadline = time.monotonic() + STARTUP_S
        while not os.path.exists(path):
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"speculators fork server did not start (exit {server.poll()}); see {path}.log")
            time.sleep(0.05)
        with open(path + ".pid", "w") as pidfile:
            pidfile.write(str(server.pid))
    sock.connect(path)
    return sock


def client(path: str, owner: int, server_python: str, argv: list[str]) -> None:
    sock = connect(path, owner, server_python)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # closing the socket stops the child
        signal.signal(sig, lambda signum, _: os._exit(128 + signum))
    socket.send_fds(sock, [b"\0"], [0, 1, 2])
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    sock.sendall(json.dumps(request).encode() + b"\n")
    reply = b""
    while chunk := sock.recv(64):
        reply += chunk
    if not reply:
        sys.exit("speculators fork server went away before its child finished")
    code = int(reply)
    if code < 0:  # killed by a signal: so is this process, as the caller expects of the script's
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        client(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
