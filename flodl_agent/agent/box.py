"""This box before a dial: what it offers, what its children start from, and made ready.

The agent's IO shell around its pure parts: torch and the cards are read for the
offer (:mod:`.offer` judges them), the environment, PATH and interfaces for the
ranks (:mod:`.rank_env` turns them into environments), and before every dial the
box is readied: the data root mounted and signed, the published run fetched and
built, the model it builds probed.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..config.devices import DeviceOffer
from ..hardware.gpus import amd_access, read_cards, read_torch
from ..hardware.offer import Offer, resolve_offer
from ..net import DEAD_MOUNT, socket_ifnames
from ..retry import Transient, failure
from ..sources.build import entry_command, rank_path
from ..train.signature import ProbeFailed, dataset_signature, probe_model
from .options import AgentOptions
from .prepare import Prepared, PrepareFailure, mount_data, prepare, ready_dir
from .rank_env import Box, box_env


def box_offer(devices: DeviceOffer) -> Offer:
    """The GPU gate on this box: torch and its cards read, then judged. CPU offers touch no torch."""
    if devices.kind == "cpu":
        return resolve_offer(devices)
    torch = read_torch()
    amd = amd_access() if torch.usable_gpus == 0 else None  # why torch sees none, if AMD cards are here
    return resolve_offer(devices, torch, read_cards(torch.usable_gpus), amd)


def this_box(options: AgentOptions) -> Box:
    """What this box's children start from."""
    return Box(
        base=dict(os.environ),
        path=rank_path(),  # the variant's venv (this interpreter's) bin/ first
        data_path=options.data_path,
        env=options.env,
        ifnames=socket_ifnames(options.socket_ifname),  # against /sys/class/net
        gpu_ram_share=options.gpu_ram_share,
    )


def signature_cache() -> Path:
    return Path.home() / ".flodl" / "cache" / "dataset-signatures.json"


def data_signature(data_path: str) -> str:
    """The data root's signature for the hello (cached in ~/.flodl between dials)."""
    try:
        return dataset_signature(data_path, signature_cache())
    except OSError as exc:
        if exc.errno in DEAD_MOUNT:
            raise Transient(
                f"the data mount at {data_path} is not connected (its sshfs died)",
                "restart it (systemctl restart flodl-join.service remounts it), then --persist re-dials",
            ) from None
        raise Transient(
            f"data_path {data_path} cannot be read: {exc.strerror or exc}",
            "mount the data root there (flodl_worker_data_mount) or fix join.data_path; --persist re-dials",
        ) from None


def own_entry(options: AgentOptions, prepared: Prepared | None) -> tuple[list[str], Path] | None:
    """What this box runs of its own, to probe, and where: the built source's entry (a
    published run's, when its manifest asks every box to probe, whatever this box says),
    else --bin / join.bin. None: nothing to probe (the launch's command, a compose service's
    ranks, or the probe turned off)."""
    if options.model_sig:  # known already (a launcher's spec)
        return None
    if prepared is not None and prepared.model_probe:
        return list(prepared.command), prepared.cwd
    if not options.model_probe or options.docker:
        return None
    if prepared is not None:
        return list(prepared.command), prepared.cwd
    if options.bin:
        return entry_command(options.bin, options.args), Path.cwd()
    return None


def _probe_model(entry: tuple[list[str], Path], options: AgentOptions, log: Callable[[str], None]) -> str:
    """The model this box builds, for the hello; "" (no signature) when the probe fails:
    the formation check is then the backstop."""
    command, cwd = entry
    try:
        cache = Path(options.stage).expanduser() / "model-signature.json"
        sig = probe_model(command, cwd, box_env(this_box(options)) | options.env, cache)
    except ProbeFailed as exc:
        log(f"model probe: {exc}; dialling without a model signature")
        return ""
    log(f"model probe: this box builds {sig[:12]}")
    return sig


async def get_ready(
    options: AgentOptions, log: Callable[[str], None], variant: str = "cpu"
) -> tuple[AgentOptions, Prepared | None]:
    """Mount, sign, fetch, build (for the torch ``variant`` the offer runs in) and probe as
    the options ask; the options with what the hello now knows (dataset_sig, run_id,
    model_sig), and the prepared run (None without a source)."""
    try:
        if options.data_source and options.data_path:
            await asyncio.to_thread(
                mount_data, options.data_source, Path(options.data_path), options.ssh, log
            )
        if options.data_path and not options.dataset_sig:
            # Before the dial: admission starts a deadline, and refuses a box whose data differs.
            ready_dir(signature_cache().parent, log)
            options = replace(options, dataset_sig=await asyncio.to_thread(data_signature, options.data_path))
        prepared = None
        if options.source is not None:
            stage = Path(options.stage).expanduser()
            prepared = await asyncio.to_thread(
                prepare, options.source, stage, options.ssh, options.args, log, variant
            )
            options = replace(options, run_id=prepared.run or options.run_id)
        if (entry := own_entry(options, prepared)) is not None:
            # Before the dial: the window then refuses a box whose model differs, by name.
            options = replace(options, model_sig=await asyncio.to_thread(_probe_model, entry, options, log))
    except PrepareFailure as exc:
        raise failure(exc.message, exc.fix, exc.code) from None
    return options, prepared
