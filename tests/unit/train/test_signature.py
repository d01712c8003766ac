"""Model and dataset signatures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flodl_agent.train.signature import (
    PROBE_ENV,
    ModelMismatch,
    ProbeFailed,
    answer_probe,
    check_formation,
    dataset_signature,
    model_signature,
    probe_model,
)


def test_the_dataset_signature_sees_names_sizes_and_content_and_is_cached(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        (root / "train").mkdir(parents=True)
        (root / "train" / "x.bin").write_bytes(b"\x01" * 200_000)
        (root / "labels.csv").write_text("0,1\n")
    assert dataset_signature(a) == dataset_signature(b)  # the same data, wherever it lives
    (b / "labels.csv").write_text("1,0\n")  # same names and sizes, other content
    assert dataset_signature(a) != dataset_signature(b)
    (b / "labels.csv").write_text("0,1\n")
    (b / "extra").write_text("")
    assert dataset_signature(a) != dataset_signature(b)
    cache = tmp_path / "cache.json"
    first = dataset_signature(a, cache)
    assert cache.is_file() and dataset_signature(a, cache) == first
    # a changed file changes its listing (size or mtime): the cache is not trusted
    (a / "labels.csv").write_text("0,1,2\n")
    assert dataset_signature(a, cache) != first


def test_a_missing_root_or_a_file_raises_instead_of_signing_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        dataset_signature(tmp_path / "missing")
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        dataset_signature(tmp_path / "file")


def test_model_signatures_and_the_formation_check() -> None:
    torch = pytest.importorskip("torch")
    small, same, wide = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1), torch.nn.Linear(3, 1)
    assert model_signature(small) == model_signature(same) != model_signature(wide)
    assert model_signature(small) != model_signature(small.double())
    check_formation({0: "aa", 1: "aa"})
    with pytest.raises(
        ModelMismatch, match=r"model mismatch at formation: ranks 0, 2 build aa; rank 1 builds bb"
    ):
        check_formation({0: "aa", 1: "bb", 2: "aa"})


def test_the_trainer_answers_a_model_probe_before_anything_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    from flodl_agent.train import Trainer

    answer_probe(torch.nn.Linear(3, 2))  # no probe asked: a no-op
    answer = tmp_path / "sig"
    monkeypatch.setenv(PROBE_ENV, str(answer))
    dataset: list[object] = []  # would refuse to shard: the probe must exit before that
    with pytest.raises(SystemExit) as done:
        Trainer(
            lambda: torch.nn.Linear(3, 2),
            dataset,
            lambda p: torch.optim.SGD(p, lr=0.1),
            torch.nn.functional.mse_loss,
        )
    assert done.value.code == 0
    assert answer.read_text() == model_signature(torch.nn.Linear(3, 2))


def test_an_entry_that_does_not_answer_the_probe_is_remembered_until_it_changes(tmp_path: Path) -> None:
    entry = tmp_path / "train.py"
    entry.write_text("print('training alone')\n")  # a plain script: it never answers
    cache = tmp_path / "model-signature.json"
    runs: list[dict[str, str]] = []

    def run(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
        runs.append(env)
        if "answer" in entry.read_text():
            Path(env[PROBE_ENV]).write_text("ab" * 32)
        return 0, "training alone\n"

    command = ["python", "train.py"]
    with pytest.raises(ProbeFailed, match="exited 0 without answering the model probe"):
        probe_model(command, tmp_path, {"RANK": "0", "PATH": "/bin"}, cache, run=run)
    assert "RANK" not in runs[0] and runs[0]["CUDA_VISIBLE_DEVICES"] == ""  # a probe is not a rank
    with pytest.raises(ProbeFailed, match="remembered until the entry changes"):
        probe_model(command, tmp_path, {}, cache, run=run)  # every re-dial: not run again
    assert len(runs) == 1
    entry.write_text("# answer\n")
    os.utime(entry, ns=(1, 1))  # the entry changed: its mtime is the cache key's
    assert probe_model(command, tmp_path, {}, cache, run=run) == "ab" * 32
    assert probe_model(command, tmp_path, {}, cache, run=run) == "ab" * 32 and len(runs) == 2
