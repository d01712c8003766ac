"""A walk-in host's ranks joining a world that is training (an elastic world's growth).

Their first round is a push of weight 0 marked ``join``; the controller answers it with the
average of whichever round it attached them to, and they count their rounds on from there.
The relay runs on its own loop thread and the test plays the controller, as in test_link_gap.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.unit.train.test_link_gap import WAIT, Plane

torch = pytest.importorskip("torch")

PARAMS = 6


@pytest.mark.parametrize(
    ("ranks", "bf16"),
    [([0], False), ([0], True), ([0, 1], False)],
    ids=["own-segment-received-in-place", "own-segment-bf16-copied-in", "two-ranks-shared-average"],
)
def test_a_join_takes_the_worlds_round_whatever_its_number(
    ranks: list[int], bf16: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    plane = Plane(ranks)
    averagers = []
    for rank in ranks:
        monkeypatch.setenv("RANK", str(rank))
        averagers.append(plane.averager(bf16))
    tensors = [torch.full((PARAMS,), float(rank + 1)) for rank in ranks]
    try:
        with ThreadPoolExecutor(len(ranks)) as pool:
            done = [pool.submit(a.average, [t], 0.0, True) for a, t in zip(averagers, tensors, strict=True)]
            ((head, data),) = plane.up.get(timeout=WAIT)
            # Folded as any round of weight 0 (round 0: the ranks' own count), marked a join.
            assert (head["round"], head["weight"], head["join"], head["params"]) == (0, 0.0, True, PARAMS)
            assert data == b""
            # The world is at round 7: the answer carries that number, in two pieces.
            first = plane.answer(head, 0, np.full(3, 5.0), round=7, weight=4.0, last=False)
            plane.answer(head, 3, np.full(3, 6.0), round=7, weight=4.0, last=True, taken=28.0)
            assert first is not bf16  # float32 lands straight where the ranks read it
            assert [d.result(WAIT) for d in done] == [4.0] * len(ranks)
        for averager, tensor in zip(averagers, tensors, strict=True):
            assert (averager.round, averager.taken) == (8, 28.0)
            assert tensor.tolist() == [5.0] * 3 + [6.0] * 3
        assert plane.relay.next_round == 8
        # The next round is the world's next one, and an ordinary round.
        with ThreadPoolExecutor(len(ranks)) as pool:
            done = [pool.submit(a.average, [t], 1.0) for a, t in zip(averagers, tensors, strict=True)]
            ((head, _),) = plane.up.get(timeout=WAIT)
            assert head["round"] == 8 and "join" not in head
            plane.answer(head, 0, np.full(PARAMS, 2.0), weight=5.0, last=True, taken=33.0)
            assert [d.result(WAIT) for d in done] == [5.0] * len(ranks)
        assert [a.round for a in averagers] == [9] * len(ranks) and averagers[0].taken == 33.0
        assert tensors[0].tolist() == [2.0] * PARAMS
    finally:
        for averager in averagers:
            averager.close()
        plane.close()
