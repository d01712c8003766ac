"""``fdl probe``: a box's facts and findings, its data root, the GPU stack captured for a
bug report, and ``fdl nccl pin``."""
