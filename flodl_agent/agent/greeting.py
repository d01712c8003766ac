"""The agent's half of a handshake: the controller's challenge, this box's hello, the answer.

One exchange for both hellos an agent says: walking into a window, and walking back in
to a restarted controller that resumed its launch (the hello's ``resume`` claim).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from ..protocol.join_protocol import Accepted, Closed, JoinClient, Refused
from ..protocol.streams import DIAL_TIMEOUT, next_event
from ..retry import AgentFailure, Permanent, Transient

# A tunnel's door that does not permit the forward accepts, then hangs up.
BROKE_FIX = (
    "through a tunnel: does the door permit a forward to the controller port "
    "(permitopen)? Otherwise the controller went away; --persist re-dials"
)


class HelloRefused(AgentFailure):
    """The controller answered the hello with a refusal (not a broken road): for a resume,
    the end of the grace."""


class TransientRefusal(Transient, HelloRefused):
    pass


class PermanentRefusal(Permanent, HelloRefused):
    pass


async def greet(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, client: JoinClient, hello: Mapping[str, Any]
) -> Accepted:
    """Say ``hello`` on a fresh connection; the controller's Accept. Raises Transient or
    Permanent (a refusal says which) when this box is not admitted."""
    writer.write(client.start())
    first = await next_event(reader, client, DIAL_TIMEOUT)
    if isinstance(first, Refused):  # turned away before any frame: rate-limited
        raise Transient(f"refused: {first.reject.reason}", first.reject.fix)
    if isinstance(first, Closed):
        # Through a tunnel, a door that forbids the forward accepts and hangs up.
        raise Transient("the connection to the controller broke before its challenge", BROKE_FIX)
    writer.write(client.hello(hello))
    await writer.drain()
    answer = await next_event(reader, client, DIAL_TIMEOUT)
    if isinstance(answer, Closed):
        raise Transient(
            "the controller dropped the hello without a reply",
            "wrong join.token, or this box is rate-limited after bad dials",
        )
    if isinstance(answer, Refused):
        refusal = answer.reject
        refused = PermanentRefusal if refusal.permanent else TransientRefusal
        raise refused(f"refused: {refusal.reason}", refusal.fix)
    assert isinstance(answer, Accepted)
    return answer
