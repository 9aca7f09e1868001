"""A local rehearsal of a real deployment: SuperLink + SuperNodes on 127.0.0.1.

TLS on (a private CA from ``scripts/gen-certs.sh``) and SuperNode
authentication on (each SuperNode has an ECDSA P-384 key, registered with
``flwr supernode register`` before it connects), following flwr 1.41's CLI.
Used by ``scripts/deploy-local.sh`` and by ``tests/test_deployment.py``.

    python -m fedaccel.deployment -n 2 -c "algo='fedcdr' num-server-rounds=2"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from fedaccel.local_run import project_dir


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


class LocalDeployment:
    """Start, use and stop a SuperLink and its SuperNodes; every process it
    starts runs in its own process group and is stopped by :meth:`stop`."""

    def __init__(self, work_dir: Path, port: int = 9091, clientapp_port: int = 9094) -> None:
        self.work = Path(work_dir).resolve()
        self.port = port
        self.clientapp_port = clientapp_port
        self.address = f"127.0.0.1:{port}"
        self.certs = self.work / "certs"
        self.logs = self.work / "logs"
        self.keys = self.work / "keys"
        self.results = self.work / "results"
        self.env = {
            **os.environ,
            "FLWR_HOME": str(self.work / "flwr-home"),
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        }
        self.superlink: subprocess.Popen | None = None
        self.supernodes: dict[int, subprocess.Popen] = {}

    # ---------------------------------------------------------------- setup
    def _spawn(self, cmd: list[str], log_name: str) -> subprocess.Popen:
        log = open(self.logs / log_name, "ab")
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                cwd=self.work, start_new_session=True)

    def flwr(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([_bin("flwr"), *args], env=self.env, cwd=project_dir(),
                              capture_output=True, text=True, timeout=timeout, check=check)

    def start_superlink(self) -> None:
        for folder in (self.logs, self.keys, self.results, Path(self.env["FLWR_HOME"])):
            folder.mkdir(parents=True, exist_ok=True)
        if not (self.certs / "ca.crt").is_file():
            subprocess.run(["bash", str(project_dir() / "scripts/gen-certs.sh"), str(self.certs)],
                           check=True, capture_output=True)
        (Path(self.env["FLWR_HOME"]) / "config.toml").write_text(
            '[superlink]\ndefault = "deployment"\n\n[superlink.deployment]\n'
            f'address = "{self.address}"\nroot-certificates = "{self.certs / "ca.crt"}"\n')
        self.superlink = self._spawn([
            _bin("flower-superlink"), "--host", "127.0.0.1", "--port", str(self.port),
            "--ssl-ca-certfile", str(self.certs / "ca.crt"),
            "--ssl-certfile", str(self.certs / "server.pem"),
            "--ssl-keyfile", str(self.certs / "server.key"),
            "--enable-supernode-auth", "--disable-runtime-dependency-installation",
        ], "superlink.log")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.superlink.poll() is not None:
                raise RuntimeError(f"SuperLink exited; see {self.logs / 'superlink.log'}")
            if self.flwr("supernode", "list", "deployment", check=False, timeout=30).returncode == 0:
                return
            time.sleep(0.5)
        raise RuntimeError(f"SuperLink did not come up; see {self.logs / 'superlink.log'}")

    def key(self, index: int) -> Path:
        """The SuperNode's ECDSA P-384 private key (OpenSSH format), made once."""
        key = self.keys / f"supernode-{index}"
        if not key.is_file():
            subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-f", str(key),
                            "-C", f"fedaccel-supernode-{index}"], check=True)
        return key

    def register(self, index: int) -> None:
        self.flwr("supernode", "register", str(self.key(index)) + ".pub", "deployment")

    def start_supernode(self, index: int, num_partitions: int, key: Path | None = None,
                        root_certificates: Path | None = None, node_config: str = "") -> subprocess.Popen:
        """A SuperNode holding partition ``index`` of ``num_partitions``;
        ``node_config``: more of its node config (``data-path='...'``)."""
        proc = self._spawn([
            _bin("flower-supernode"), "--superlink", self.address,
            "--root-certificates", str(root_certificates or self.certs / "ca.crt"),
            "--auth-supernode-private-key", str(key or self.key(index)),
            "--node-config", f"partition-id={index} num-partitions={num_partitions} {node_config}".strip(),
            "--port", str(self.clientapp_port + index),
        ], f"supernode-{index}.log")
        self.supernodes[index] = proc
        return proc

    def node_status(self, node_id: int) -> str | None:
        """``online``/``offline``/... as the SuperLink lists the node (None if unknown)."""
        listing = json.loads(self.flwr("supernode", "list", "deployment", "--format", "json").stdout)
        return next((n["status"] for n in listing.get("nodes", []) if int(n["node-id"]) == node_id), None)

    def node_ids(self, index: int) -> list[int]:
        """The node ids SuperNode ``index`` was given, one per successful start
        (its log is appended to across restarts)."""
        log = self.logs / f"supernode-{index}.log"
        text = log.read_text(errors="replace") if log.is_file() else ""
        return [int(m) for m in re.findall(r"SuperNode ID: (\d+)", text)]

    def restart_supernode(self, index: int, num_partitions: int, timeout: float = 150,
                          retry_every: float = 3.0) -> int:
        """Start SuperNode ``index`` again with the same key and node config, the
        way a supervisor (systemd ``Restart=on-failure``) would; returns its node id.

        After a crash the SuperLink still counts the old session as online until
        two heartbeats are missed (up to ~60 s with flwr 1.41's 30 s interval)
        and refuses to activate the same key meanwhile (code 2004, exit 305), so
        this retries until a start is accepted."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            before = len(self.node_ids(index))
            proc = self.start_supernode(index, num_partitions)
            while proc.poll() is None and len(self.node_ids(index)) == before:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            if len(self.node_ids(index)) > before:
                return self.node_ids(index)[-1]
            self._kill(proc)
            proc.wait(timeout=10)
            time.sleep(retry_every)
        raise RuntimeError(f"SuperNode {index} was not accepted again within {timeout:.0f} s; "
                           f"see {self.logs / f'supernode-{index}.log'}")

    def start(self, num_nodes: int) -> None:
        self.start_superlink()
        for i in range(num_nodes):
            self.register(i)
            self.start_supernode(i, num_nodes)

    # ------------------------------------------------------------------ use
    def run(self, run_config: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """``flwr run . deployment --stream`` with results under work/results."""
        config = f"{run_config} results-dir='{self.results}'"
        return self.flwr("run", ".", "deployment", "--stream", "--run-config", config,
                         timeout=timeout, check=False)

    def run_async(self, run_config: str) -> subprocess.Popen:
        config = f"{run_config} results-dir='{self.results}'"
        return subprocess.Popen([_bin("flwr"), "run", ".", "deployment", "--stream",
                                 "--run-config", config], env=self.env, cwd=project_dir(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    # ----------------------------------------------------------------- stop
    @staticmethod
    def _kill(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill_supernode(self, index: int) -> None:
        """Kill a SuperNode abruptly (SIGKILL), as a crashed device would."""
        self._kill(self.supernodes[index], signal.SIGKILL)
        self.supernodes[index].wait(timeout=10)

    def stop(self) -> None:
        procs = list(self.supernodes.values()) + ([self.superlink] if self.superlink else [])
        for proc in procs:
            self._kill(proc)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._kill(proc, signal.SIGKILL)
                proc.wait(timeout=10)
        self.supernodes.clear()
        self.superlink = None

    def __enter__(self) -> "LocalDeployment":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deploy-local", description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--supernodes", type=int, default=2)
    parser.add_argument("-c", "--run-config", default="num-server-rounds=2")
    parser.add_argument("-d", "--work-dir", default=".deploy")
    parser.add_argument("-p", "--port", type=int, default=int(os.environ.get("FEDACCEL_SUPERLINK_PORT", 9091)))
    args = parser.parse_args(argv)
    with LocalDeployment(Path(args.work_dir), port=args.port) as deployment:
        print(f"[deploy] SuperLink on {deployment.address} (TLS, SuperNode authentication); "
              f"{args.supernodes} SuperNode(s) with registered ECDSA keys")
        deployment.start(args.supernodes)
        proc = deployment.run_async(args.run_config)
        for line in proc.stdout or ():
            print(line, end="")
        code = proc.wait()
    print(f"[deploy] stopped the SuperLink and {args.supernodes} SuperNode(s); "
          f"results under {deployment.results}")
    return code


if __name__ == "__main__":
    sys.exit(main())
