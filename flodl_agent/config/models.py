"""The typed schema of ``fdl.yml`` and ``fdl.cluster.yml``: the whole document.

Field-level checks live on the types (:mod:`.fields`); rules that tie fields
together live in ``model_validator``s on the blocks (:mod:`.cluster`,
:mod:`.join_window`, :mod:`.join`) and report the exact field they blame. Every
failure is a ``PydanticCustomError`` of type ``flodl`` whose context carries the
message, the fix and, for rules, the path relative to the model that raised it —
the translation in :mod:`.validate` turns those into :class:`Problem`s.

Every block is re-exported here: ``from flodl_agent.config.models import X``
names any of them.
"""

from __future__ import annotations

from pydantic import Field

from .cluster import Cluster, Controller, Ssh, Tls, Worker
from .fields import (
    DEFAULT_JOIN_TIMEOUT,
    DEFAULT_MAX_JOIN_TIMEOUT,
    DEFAULT_PORT,
    RANK_IDENTITY,
    RESERVED_PREFIX,
    VISIBILITY_MASKS,
    CommandLine,
    CommandName,
    Model,
    OsText,
    SourceSpecText,
)
from .join import Join, Source
from .join_window import JoinWindow

__all__ = [
    "DEFAULT_JOIN_TIMEOUT",
    "DEFAULT_MAX_JOIN_TIMEOUT",
    "DEFAULT_PORT",
    "LEGACY_KEYS",
    "RANK_IDENTITY",
    "RESERVED_PREFIX",
    "VISIBILITY_MASKS",
    "Cluster",
    "Controller",
    "FdlConfig",
    "Join",
    "JoinWindow",
    "Publish",
    "Source",
    "Ssh",
    "Tls",
    "Worker",
]


class Publish(Model):
    """The publish block of fdl.yml: the defaults of every `fdl publish` flag."""

    source: SourceSpecText | None = Field(None, description="source spec to publish")
    bin: OsText | None = Field(None, description="entry point, relative to cwd")
    cwd: OsText | None = Field(None, description="project dir inside the tree")
    build: OsText | None = Field(None, description="build line run once as the gate")
    to: OsText | None = Field(None, description="served directory (default ~/.flodl/run)")
    identity: OsText | None = Field(None, description="ssh key for rsync:// and git+ssh:// sources")
    args: list[OsText] = Field(default_factory=list, description="arguments every rank gets")
    model_probe: bool = Field(False, description="probe the entry's model at publish and on every box")


class FdlConfig(Model):
    """A whole fdl.yml (optionally with a cluster file overlaid)."""

    cluster: Cluster | None = Field(None, description="the cluster: controller and workers")
    join: Join | None = Field(None, description="walk-in defaults for `fdl join`")
    publish: Publish | None = Field(None, description="defaults for `fdl publish`")
    commands: dict[CommandName, CommandLine] = Field(
        default_factory=dict, description="named run commands for `fdl @<cluster> <name>`"
    )


# Keys of older schemas, with what replaced them.
LEGACY_KEYS: dict[str, str] = {
    "master_addr": "cluster.controller.host",
    "master_port": "cluster.controller.port",
    "ssh_target": "ssh.target",
    "ssh_host": "ssh.target",
    "ssh_port": "ssh.port",
    "ssh_user": "ssh.user",
    "ssh_key": "ssh.identity_file",
    "ssh_identity": "ssh.identity_file",
    "ssh_identity_file": "ssh.identity_file",
    "ssh_options": "ssh.options",
    "ssh_opts": "ssh.options",
}
