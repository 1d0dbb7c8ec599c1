"""The dev server as a child process, for tests, benchmarks and the dev stack."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class DevServerProcess:
    """The dev server as a child process on a free 127.0.0.1 port; `stop()` kills it by PID."""

    def __init__(
        self,
        tokenizer_dir: str | Path,
        config_path: str | Path | None = None,
        log_path: str | Path | None = None,
        # a bound, not a pace: a server that dies fails at once (wait_http_ok), while one niced under a
        # saturated machine (the benchmark smokes beside make test's tiers) may take minutes to answer
        startup_timeout_s: float = 600.0,
        *,
        pipeline_config: str | Path | None = None,
        api_key: str | None = None,
    ):
        import os
        import subprocess
        import sys

        from eagle3_data.dev.processes import free_port, wait_http_ok

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-c",
            "from eagle3_data.cli import main; raise SystemExit(main())",
            "dev",
            "serve",
            "--port",
            str(self.port),
            "--tokenizer",
            str(tokenizer_dir),
        ]
        if config_path:
            cmd += ["--config", str(config_path)]
        if pipeline_config:
            cmd += ["--pipeline-config", str(pipeline_config)]
        if api_key:
            cmd += ["--api-key", api_key]
        self._log = open(log_path or os.devnull, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_http_ok(f"{self.url}/health", [self.proc], "dev inference server", log_path, startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def stats(self) -> dict[str, Any]:
        from eagle3_data.dev.processes import local_http

        stats: dict[str, Any] = local_http().get(f"{self.url}/dev/stats", timeout=30).json()
        return stats

    def configure(self, config: dict[str, Any]) -> None:
        """Replace the running server's config (YAML keys) and reset its counters."""
        from eagle3_data.dev.processes import local_http

        r = local_http().post(f"{self.url}/dev/config", json=config, timeout=30)
        if r.status_code != 200:
            raise ValueError(r.text)

    def stop(self) -> None:
        import os
        import signal

        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._log.close()
