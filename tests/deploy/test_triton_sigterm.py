"""`kill <launcher PID>` stops the Triton launcher (`python -m stepserve.deploy.triton.server REPO`) as Ctrl-C does:
tritonserver and its Python stubs end, its ports are free again and its temporary folder is gone."""

from __future__ import annotations

import socket

import pytest
from extras import require
from leftovers import Command, gone_within

from stepserve.deploy.triton.repository import RepositoryOptions, write_repository
from stepserve.util.ports import free_ports

pytestmark = pytest.mark.timeout(300)


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds: TIME_WAIT is no listener
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_sigterm_stops_tritonserver_and_its_stubs(embedded_onnx, tmp_path):
    require("pytriton", "triton")
    repo = write_repository(embedded_onnx, tmp_path / "repo", RepositoryOptions(mode="stepserve", max_batch_size=2,
                                                                                 threads=1), quiet=True)
    ports = free_ports(3)
    command = Command([str(repo), "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port",
                       str(ports[2])], tmp_path, module="stepserve.deploy.triton.server")
    try:
        assert command.wait_for(lambda: "triton: serving" in command.output, 240), command.output[-3000:]
        assert len(command.processes()) >= 3  # the launcher, tritonserver, the pipeline's stub
        code, _ = command.terminate_and_wait(60)
        assert code == 0, (code, command.output[-3000:])
        assert gone_within(command.processes, 60) == []
        assert all(_free(port) for port in ports)
        # its temporary folder (backend links, log) is gone; a library's own session file there may stay
        assert list(command.tmpdir.glob("stepserve-triton-*")) == []
    finally:
        command.clean_up()
