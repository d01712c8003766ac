"""The controller's door: every join connection's challenge, hello and admission.

A join hello is judged by ``admission`` against the cohort while the window is open; a
resume hello (a host whose ranks trained on while no controller ran) by ``readoption``
when this controller resumed a journaled launch. Either way the hello is first proven
with the host key of the name it gives (``join_protocol``), and an admitted host's
connection becomes its control link (the controller's ``_link``).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..config.ranks import rank_span
from ..names import shown
from ..protocol import wire
from ..protocol.join_protocol import HelloReceived, JoinServer, KeyRefused, WrongKey
from ..protocol.messages import Hello
from ..protocol.streams import next_event
from . import admission
from .admission import NO_KEY_WORDS, WRONG_KEY_WORDS, Cohort, Refusal
from .host_link import Link
from .listener import Listener, Timeouts
from .readoption import Readoption
from .settings import Settings
from .window import Fail, Form, Keep, Window


class Hellos:
    """The half of the controller that admits: mixed into ``Controller``, which owns the state."""

    settings: Settings
    open: bool
    key: bytes
    salt: bytes
    window: Window
    cohort: Cohort
    timeouts: Timeouts
    links: dict[str, Link]
    listener: Listener
    refused: Counter[str]
    admitted: int
    readoption: Readoption | None
    clock: Callable[[], float]
    note: Callable[[str, str], None]
    _handshakes: int

    # What the controller's other half does with an admitted or lost link.
    def _register(self, link: Link, first: int) -> None: ...
    def _unregister(self, link: Link) -> None: ...
    def _closed(self, host: str) -> None: ...
    def _apply(self, decision: Keep | Form | Fail) -> None: ...
    async def _link(self, reader: asyncio.StreamReader, link: Link) -> None: ...
    def _readopted(self, link: Link) -> None: ...

    if TYPE_CHECKING:  # the formation half's (Forming): a stub here would shadow it in the MRO

        def _growth_refusal(self, hello: Hello) -> Refusal | None: ...
        def _grown(self, link: Link, writer: asyncio.StreamWriter, conn: JoinServer) -> None: ...

    @property
    def dropped(self) -> Counter[str]:
        return self.listener.gate.dropped

    async def _join(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: str,
        settle: Callable[[], None],
    ) -> None:
        if self._handshakes >= self.timeouts.handshakes:
            self.dropped["busy"] += 1
            self.listener.say("drop", (peer, "busy"), f"turned {peer} away: every handshake slot is taken")
            return
        self._handshakes += 1
        try:
            link = await self._handshake(reader, writer, peer)
        finally:
            self._handshakes -= 1
            settle()  # admitted or not, the handshake is over
        if link is not None:
            await self._link(reader, link)

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str
    ) -> Link | None:
        """Challenge, hello, admission; the admitted host's link, or None."""
        conn = JoinServer(None if self.open else self.key, salt=self.salt)
        writer.write(conn.start())
        try:
            event = await next_event(reader, conn, self.timeouts.hello)
        except WrongKey as exc:
            writer.write(exc.reply)  # the box learns why, and stops
            host = shown(exc.host)  # unproven, and as long as a hello may be: cut for the log
            self._bad_key(peer, host, WRONG_KEY_WORDS.format(host=host))
            return None
        if isinstance(event, KeyRefused):
            self._bad_key(peer, "", NO_KEY_WORDS)
            return None
        if not isinstance(event, HelloReceived):
            return None  # the peer hung up
        hello = event.hello
        refusal = self._admit(hello)
        if refusal is not None:
            # Keyed by the host too: every tunnelled walk-in arrives from 127.0.0.1.
            key = (peer, refusal.code, hello.host)
            self._refused(key, refusal.code, f"refused {hello.host or peer}: {refusal.reason}")
            writer.write(conn.refuse(refusal.reason, refusal.fix, permanent=refusal.permanent))
            await writer.drain()
            return None
        link = Link(hello, writer, conn, time.time(), peer)
        if hello.resume is not None:  # only a readoption admits one
            # Accept first: it rekeys the link, and what readoption sends (an abandoned round) follows it.
            writer.write(conn.accept(hello.resume.first, hello.resume.count))
            self._readopted(link)
        else:
            self._admitted(link, writer, conn)
        try:
            await writer.drain()
        except (ConnectionError, OSError):
            # A failed Accept write rolls the admission back (or, after the freeze, is a lost host).
            if self.links.get(hello.host) is link:
                self._unregister(link)
                self._closed(hello.host)
            return None
        return link

    def _admitted(self, link: Link, writer: asyncio.StreamWriter, conn: JoinServer) -> None:
        if self.window.phase == "training":  # an elastic launch's walk-in (_admit allowed it)
            self._grown(link, writer, conn)
            return
        hello, peer = link.hello, link.peer
        first = self.window.joined_ranks
        count = len(hello.devices)
        decision = self.window.join(hello.host, count, self.clock())  # _admit checked the phase
        self._register(link, first)
        # The accept rekeys the link: whatever follows (a WorldFormed this very join
        # may trigger) speaks this connection's key.
        writer.write(conn.accept(first, count))
        self.admitted += 1
        span = rank_span(range(first, first + count), noun=True)
        self.note(
            "join", f"admitted {hello.host} ({peer}): {span} on {', '.join(hello.devices)}; runs {hello.runs}"
        )
        self._apply(decision)

    def host_key(self, host: str) -> bytes | None:
        """What an agent dials as ``host`` with (a fan-out's spec); None under open admission."""
        return None if self.open else wire.host_key(self.key, host)

    def _refused(self, key: tuple[str, ...], code: str, line: str) -> None:
        """Count every refusal; log one per ``key`` (peer, reason) a minute: floods must not fill disks."""
        self.refused[code] += 1
        self.listener.say("refusal", key, line)

    def _bad_key(self, peer: str, host: str, words: str) -> None:
        self._refused((peer, "bad_key", host), "bad_key", f"refused {host or peer}: {words}")
        self.listener.charge(peer)  # a bad dial: the dial guard's budget pays for it

    def _admit(self, hello: Hello) -> Refusal | None:
        readoption = self.readoption
        # A resumed elastic launch grows again once its readoption is over (the hosts not back
        # are lost by then, their ranks free); until then only its journaled hosts walk in.
        if readoption is not None and (
            hello.resume is not None or not readoption.said or not self.settings.elastic
        ):
            if self.window.phase != "training":
                return admission.window_closed(self.window.phase)  # the resumed run has ended
            return readoption.judge(hello, set(self.links))
        if hello.resume is not None or self.window.can_admit():
            # A resume hello learns that no launch was resumed, whatever the window's phase.
            return admission.check(self.cohort, hello, self.settings.plane, self.settings.tunnel_only)
        if self.window.phase == "training" and self.settings.elastic is not None:
            # Growth: the same admission as before the freeze, then elastic's own rules.
            refusal = admission.check(self.cohort, hello, self.settings.plane, self.settings.tunnel_only)
            return refusal or self._growth_refusal(hello)
        return admission.window_closed(self.window.phase)
