"""The join protocol: a connection's first bytes, authenticated frames and keys, the
messages, the sans-IO handshake, and the asyncio streams, TLS and tunnel that carry it."""
