from __future__ import annotations

import textwrap

import pytest

from tests.sshd import sshd  # noqa: F401  (a private OpenSSH server on loopback)


@pytest.fixture
def two_workers() -> str:
    return textwrap.dedent(
        """\
        cluster:
          controller:
            host: 10.0.0.1
          workers:
            - host: node-a
              local_devices: [0, 1]
              nccl_socket_ifname: eth0
            - host: node-b
              local_devices: cpu:2
              nccl_socket_ifname: eth0
        """
    )
