"""`eagle3-data dev s3 start|stop`: a real SeaweedFS in the background, loopback only, real keys,
data kept across restarts, stopped by PID with its port freed; two instances side by side."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_data.storage import s3_client

pytestmark = pytest.mark.slow

CLI = [str(Path(sys.executable).parent / "eagle3-data")]


def cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "dev", "s3", *args], env=env, capture_output=True, text=True, timeout=120)


def exports(stdout: str) -> dict[str, str]:
    """The `export NAME=value` lines `dev s3 start|status` prints."""
    return dict(
        line.removeprefix("export ").split("=", 1) for line in stdout.splitlines() if line.startswith("export ")
    )


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def listening_addresses(pid: int) -> set[str]:
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout
    return {line.split()[3].rsplit(":", 1)[0] for line in out.splitlines() if f"pid={pid}," in line}


def test_cli_start_stop_restart_keeps_data_and_refuses_wrong_keys(tmp_path, s3_server):
    env = dict(os.environ, AWS_ACCESS_KEY_ID="cli-test-key", AWS_SECRET_ACCESS_KEY="cli-test-secret-value")
    d = tmp_path / "s3"
    started = cli("start", "--dir", str(d), env=env)
    try:
        assert started.returncode == 0, started.stderr
        info = exports(started.stdout)
        assert "cli-test-secret-value" not in started.stdout + started.stderr
        assert (
            "AWS_SECRET_ACCESS_KEY" not in info and info["AWS_ACCESS_KEY_ID"] == "cli-test-key"
        )  # own secret not echoed
        pid, endpoint = int(started.stdout.split("# pid ", 1)[1].split()[0]), info["AWS_ENDPOINT_URL"]
        port = int(endpoint.rsplit(":", 1)[1])
        assert (d / "weed.pid").read_text().strip() == str(pid)
        if Path("/proc").exists():
            assert listening_addresses(pid) == {"127.0.0.1"}
        assert "cli-test-secret-value" not in (d / "weed.json").read_text()
        assert "cli-test-secret-value" not in (d / "weed.log").read_text()

        client = s3_client(endpoint, access_key="cli-test-key", secret_key="cli-test-secret-value")
        client.create_bucket(Bucket="persist")
        client.put_object(Bucket="persist", Key="a/b.txt", Body=b"kept")
        s3_server.client().list_buckets()  # the session's instance answers beside this one

        wrong = s3_client(endpoint, access_key="cli-test-key", secret_key="not-the-secret", max_attempts=1)
        with pytest.raises(Exception, match="SignatureDoesNotMatch|InvalidAccessKeyId|AccessDenied"):
            wrong.list_buckets()
        unknown = s3_client(endpoint, access_key="someone-else", secret_key="cli-test-secret-value", max_attempts=1)
        with pytest.raises(Exception, match="SignatureDoesNotMatch|InvalidAccessKeyId|AccessDenied"):
            unknown.get_object(Bucket="persist", Key="a/b.txt")

        stopped = cli("stop", "--dir", str(d), env=env)
        assert stopped.returncode == 0 and stopped.stdout.strip() == "stopped"
        assert not port_open(port)
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(") ")[1][:1]
        assert cli("status", "--dir", str(d), env=env).returncode == 1

        again = cli("start", "--dir", str(d), env=env)
        assert again.returncode == 0, again.stderr
        assert exports(again.stdout)["AWS_ENDPOINT_URL"] == endpoint
        assert client.get_object(Bucket="persist", Key="a/b.txt")["Body"].read() == b"kept"
    finally:
        cli("stop", "--dir", str(d), env=env)
    assert cli("stop", "--dir", str(d), env=env).stdout.strip() == "not running"


def test_start_on_busy_port_is_a_clear_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = cli("start", "--dir", str(tmp_path / "s3"), "--port", str(port), env=dict(os.environ))
    assert result.returncode == 2 and f"port {port}" in result.stderr and "Traceback" not in result.stderr


def test_a_hundred_buckets_each_get_writable_volumes(tmp_path):
    """Every bucket is a SeaweedFS collection with volumes of its own: with `weed mini`'s default
    volume limit a fresh server refused writes at the 72nd bucket ("No writable volumes and no
    free volumes left"), which broke a full test session that creates a bucket per test."""
    from eagle3_data.dev.seaweedfs import start_seaweedfs, stop_seaweedfs

    handle = start_seaweedfs(tmp_path / "s3", access_key="many-buckets", secret_key="s" * 32)
    try:
        client = handle.client()
        for i in range(100):
            client.create_bucket(Bucket=f"bucket-{i:03d}")
            client.put_object(Bucket=f"bucket-{i:03d}", Key="k", Body=b"v")
        assert client.get_object(Bucket="bucket-099", Key="k")["Body"].read() == b"v"
    finally:
        stop_seaweedfs(tmp_path / "s3", 0.5)
