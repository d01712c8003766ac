"""The walk-in agent: its options, the persist loop and one attempt, the box before a
dial, its ranks (processes or compose containers), their environment and output."""
