"""Coverage-guided fuzzing (atheris) of everything a peer's bytes reach before admission:
the frame codec in any chunking, authentic frames with arbitrary payloads (msgpack, the
message models), and admission's checks on whatever hello validates.

    python -m tests.fuzz.frames -runs=20000            # what `make test` runs (through pytest)
    make fuzz                                          # five minutes, corpus in build/fuzz

Expected refusals (Dropped, BadMessage) are the point; any other exception, or a
receive buffer that outgrows its cap, is a finding and stops the run with its input.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from flodl_agent.controller.admission import Cohort, check
    from flodl_agent.protocol import wire
    from flodl_agent.protocol.messages import BadMessage, Hello, parse

KEY = bytes(range(32))
CAP = 4096


def one(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    chunk = fdp.ConsumeIntInRange(1, 97)
    authentic = fdp.ConsumeBool()
    kind = fdp.ConsumeIntInRange(0, 20)
    payload = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, CAP + 64))
    rest = fdp.ConsumeBytes(fdp.remaining_bytes())
    if authentic:
        # An authentic frame around arbitrary payload bytes: past the tag, into msgpack and the models.
        tag = wire.Codec(KEY)._tag(0, kind, payload, b"")
        raw = wire.HEADER.pack(wire.MAGIC, wire.VERSION, kind, len(payload), tag) + payload + rest
    else:
        raw = payload + rest
    rx = wire.Codec(KEY, max_payload=CAP)
    try:
        for i in range(0, len(raw), chunk):
            rx.feed(raw[i : i + chunk])
            if rx.buffered > wire.HEADER.size + CAP + chunk:
                raise AssertionError(f"receive buffer grew to {rx.buffered}")
            for frame in rx.frames():
                message = parse(frame)
                if isinstance(message, Hello):
                    check(Cohort(), message, "cpu")
                    check(Cohort(), message, "nccl")
    except (wire.Dropped, BadMessage):
        pass


def main() -> None:
    atheris.Setup(sys.argv, one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
