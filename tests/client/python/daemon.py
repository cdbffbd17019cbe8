"""Starts the real flashsamplerd for the end-to-end tests: CPU backend,
synthetic weights named explicitly, port 0 (the bound port read back from the
log), stderr drained so that it never blocks on a full pipe.
"""

import os
import re
import signal
import socket
import subprocess
import threading
from typing import List, Optional

TERM_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """flashsamplerd at self.target; stop() sends SIGTERM and returns the
    exit status (or a string when it had to be killed)."""

    def __init__(self, vocab: int, hidden: int,
                 extra_args: Optional[List[str]] = None) -> None:
        extra_args = list(extra_args or [])
        if not any(a.startswith("--metrics_port=") for a in extra_args):
            # Tests run in parallel: never the default metrics port.
            extra_args += [f"--metrics_port={free_port()}",
                           "--metrics_address=127.0.0.1"]
        env = dict(os.environ, NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1",
                   TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
        self.process = subprocess.Popen(
            [os.environ["FLASHSAMPLERD"], "--listen_address=127.0.0.1:0",
             f"--weights=synthetic:vocab={vocab},hidden={hidden},seed=3",
             "--backend=cpu", "--cpu_threads=2", "--drain_timeout=5s",
             *extra_args],
            stderr=subprocess.PIPE, text=True, env=env)
        self.log: List[str] = []
        port_found = threading.Event()

        def read_log() -> None:
            for line in self.process.stderr:
                self.log.append(line)
                if "serving on port" in line:
                    port_found.set()
            port_found.set()

        self.reader = threading.Thread(target=read_log, daemon=True)
        self.reader.start()
        port_found.wait(120)
        match = re.search(r"serving on port (\d+)", "".join(self.log))
        if match is None or self.process.poll() is not None:
            self.process.kill()
            self.process.wait()
            raise RuntimeError("flashsamplerd did not start:\n" +
                               "".join(self.log))
        self.target = f"127.0.0.1:{match.group(1)}"

    def stop(self):
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(TERM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            code = "still running after SIGTERM"
        self.reader.join(5)
        if not self.reader.is_alive():
            self.process.stderr.close()
        return code
