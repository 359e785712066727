from __future__ import annotations

import socket
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from attnscore.g2p import train as train_mod
from attnscore.g2p.checkpoint import load_checkpoint, load_model
from attnscore.g2p.data import PAD_ID, encode_words, make_batch
from attnscore.g2p.evaluate import evaluate, predict
from attnscore.g2p.scorers import SCORERS
from attnscore.g2p.train import TrainConfig, build_model, prepare_data, run_training


def tiny_config(data: Path, out: Path, **kw: object) -> TrainConfig:
    cfg = TrainConfig(
        out=str(out),
        data=str(data),
        emb=16,
        enc_hidden=24,
        dec_hidden=24,
        dropout=0.1,
        batch_size=16,
        lr=1e-2,
        epochs=2,
        eval_every=0,
        ckpt_every=5,
        progress=False,
        label_smoothing=0.0,
    )
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def mean_loss(model: nn.Module, cfg: TrainConfig) -> float:
    data = prepare_data(cfg, report=False)
    batch = make_batch(data.train_pairs, data.letters, data.phones)
    model.eval()
    with torch.no_grad():
        logits = model(batch.src, batch.src_lens, batch.tgt_in)
    return float(
        nn.functional.cross_entropy(
            logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=PAD_ID
        )
    )


def params(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path)["model"]


def assert_same_params(a: Path, b: Path, atol: float = 0.0) -> None:
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], atol=atol, rtol=atol, msg=k)


@pytest.mark.parametrize("scoring", sorted(SCORERS))
def test_every_scorer_trains_and_decodes(toy_dict: Path, tmp_path: Path, scoring: str) -> None:
    cfg = tiny_config(toy_dict, tmp_path / scoring, scoring=scoring, epochs=1, ckpt_every=0)
    torch.manual_seed(0)
    summary = run_training(cfg)
    assert summary["steps"] > 0 and summary["parameters"] > 0
    model, letters, phones, _ = load_model(tmp_path / scoring / "last.pt")
    prons, atts = predict(model, ["abba", "mosk"], letters, phones, beam=3)
    assert len(prons) == 2
    for word, pron, att in zip(["abba", "mosk"], prons, atts, strict=True):
        assert att.shape == (len(pron) + 1, len(word))
        torch.testing.assert_close(att.sum(-1), torch.ones(len(pron) + 1))


def test_training_lowers_the_loss_and_learns(toy_dict: Path, tmp_path: Path) -> None:
    cfg = tiny_config(toy_dict, tmp_path / "run", epochs=6, eval_every=20, dropout=0.0)
    train_mod._seed_all(cfg.seed)
    before = mean_loss(build_model(cfg, prepare_data(cfg, report=False)), cfg)
    summary = run_training(cfg)
    model, letters, phones, _ = load_model(tmp_path / "run" / "last.pt")
    after = mean_loss(model, cfg)
    assert after < 0.5 * before
    assert (tmp_path / "run" / "best.pt").is_file()
    assert summary["history"] and summary["best_valid_wer"] is not None
    data = prepare_data(cfg, report=False)
    res = evaluate(model, data.splits["train"], letters, phones)
    assert res.per < 0.5  # the toy language is regular: the model must be learning it
    # beam search with one beam is greedy decoding; a wider beam decodes every word too
    words = sorted(data.splits["train"])[:40]
    src, lens = encode_words(words, letters)
    ids_g, att_g = model.greedy(src, lens)
    ids_b, att_b = model.beam_search(src, lens, beam=1)
    assert ids_g == ids_b
    for a, b in zip(att_g, att_b, strict=True):
        torch.testing.assert_close(a, b)
    ids_5, att_5 = model.beam_search(src, lens, beam=5)
    assert len(ids_5) == len(words)
    assert all(a.shape == (len(i) + 1, len(w)) for i, a, w in zip(ids_5, att_5, words, strict=True))
    assert evaluate(model, data.splits["train"], letters, phones, beam=4).per < 0.5


class _KilledError(Exception):
    pass


def _fail_at(monkeypatch: pytest.MonkeyPatch, step: int, exc: type[BaseException]) -> None:
    real = train_mod._train_step
    calls = {"n": 0}

    def step_or_fail(*args: object, **kw: object) -> int:
        calls["n"] += 1
        if calls["n"] == step:
            raise exc()
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(train_mod, "_train_step", step_or_fail)


def test_resume_after_ctrl_c_and_after_kill(
    toy_dict: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # dropout > 0: resuming must also restore the random number generator
    ref = tiny_config(toy_dict, tmp_path / "ref", dropout=0.2)
    run_training(ref)

    # Ctrl-C at step 8 (mid-epoch): the checkpoint is written on the way out
    cfg = replace(ref, out=str(tmp_path / "ctrlc"))
    with monkeypatch.context() as m:
        _fail_at(m, 8, KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            run_training(cfg)
    assert load_checkpoint(tmp_path / "ctrlc" / "last.pt")["state"]["step"] == 7
    run_training(cfg, resume=True)
    assert_same_params(tmp_path / "ref" / "last.pt", tmp_path / "ctrlc" / "last.pt")

    # a killed process: nothing is saved on the way out, the step-5 checkpoint is used
    cfg = replace(ref, out=str(tmp_path / "killed"))
    with monkeypatch.context() as m:
        _fail_at(m, 9, _KilledError)
        with pytest.raises(_KilledError):
            run_training(cfg)
    assert load_checkpoint(tmp_path / "killed" / "last.pt")["state"]["step"] == 5
    run_training(cfg, resume=True)
    assert_same_params(tmp_path / "ref" / "last.pt", tmp_path / "killed" / "last.pt")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_process_ddp_equals_one_process(toy_dict: Path, tmp_path: Path) -> None:
    # batch 15: odd global batches and a last batch of 1 example (rank 1 gets none) included
    one = tiny_config(
        toy_dict, tmp_path / "one", dropout=0.0, batch_size=15, epochs=1, ckpt_every=0
    )
    run_training(one)
    two = replace(one, out=str(tmp_path / "two"))
    train_mod.spawn_training(two, nprocs=2, port=_free_port())
    assert (
        load_checkpoint(tmp_path / "two" / "last.pt")["state"]["step"]
        == load_checkpoint(tmp_path / "one" / "last.pt")["state"]["step"]
    )
    assert_same_params(tmp_path / "one" / "last.pt", tmp_path / "two" / "last.pt", atol=1e-5)
