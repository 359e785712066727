from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from attnscore.g2p import train as train_mod
from attnscore.g2p.checkpoint import load_checkpoint, load_model
from attnscore.g2p.config import ModelConfig, TrainConfig
from attnscore.g2p.data import PAD_ID, encode_words, make_batch
from attnscore.g2p.evaluate import evaluate, predict
from attnscore.g2p.train import build_model, free_port, prepare_data, run_training
from attnscore.registry import scorer_names

STEPS_PER_EPOCH = 14  # 216 toy training pairs in batches of 16


def tiny_config(
    data: Path, out: Path, *, scoring: str = "additive", dropout: float = 0.1, **kw: object
) -> TrainConfig:
    cfg = TrainConfig(
        model=ModelConfig(scoring=scoring, emb=16, enc_hidden=24, dec_hidden=24, dropout=dropout),
        out=str(out),
        data=str(data),
        batch_size=16,
        lr=1e-2,
        steps=2 * STEPS_PER_EPOCH,
        eval_every=0,
        ckpt_every=5,
        progress=False,
        label_smoothing=0.0,
    )
    return replace(cfg, **kw)  # type: ignore[arg-type]


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


@pytest.mark.parametrize("scoring", scorer_names())
def test_every_scorer_trains_and_decodes(toy_dict: Path, tmp_path: Path, scoring: str) -> None:
    cfg = tiny_config(
        toy_dict, tmp_path / scoring, scoring=scoring, steps=STEPS_PER_EPOCH, ckpt_every=0
    )
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
    cfg = tiny_config(
        toy_dict, tmp_path / "run", steps=6 * STEPS_PER_EPOCH, eval_every=20, dropout=0.0
    )
    torch.manual_seed(cfg.seed)
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
    real = train_mod._Run.step
    calls = {"n": 0}

    def step_or_fail(self: train_mod._Run, idx: list[int], lr: float) -> tuple[int, float]:
        calls["n"] += 1
        if calls["n"] == step:
            raise exc()
        return real(self, idx, lr)

    monkeypatch.setattr(train_mod._Run, "step", step_or_fail)


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


def test_two_process_ddp_equals_one_process(toy_dict: Path, tmp_path: Path) -> None:
    # batch 15: odd global batches and a last batch of 1 example (rank 1 gets none) included
    one = tiny_config(
        toy_dict, tmp_path / "one", dropout=0.0, batch_size=15, steps=15, ckpt_every=0
    )
    run_training(one)
    two = replace(one, out=str(tmp_path / "two"))
    train_mod.spawn_training(two, nprocs=2, port=free_port())
    assert (
        load_checkpoint(tmp_path / "two" / "last.pt")["state"]["step"]
        == load_checkpoint(tmp_path / "one" / "last.pt")["state"]["step"]
    )
    assert_same_params(tmp_path / "one" / "last.pt", tmp_path / "two" / "last.pt", atol=1e-5)


def test_same_command_and_seed_give_identical_numbers(toy_dict: Path, tmp_path: Path) -> None:
    # dropout > 0 and periodic validation: every source of randomness is seeded
    a = tiny_config(toy_dict, tmp_path / "a", eval_every=7, threads=1)
    b = replace(a, out=str(tmp_path / "b"))
    sa, sb = run_training(a), run_training(b)
    assert len(sa["history"]) == 4
    keys = ("step", "train_loss", "valid_per", "valid_wer")
    assert [[h[k] for k in keys] for h in sa["history"]] == [
        [h[k] for k in keys] for h in sb["history"]
    ]
    assert_same_params(tmp_path / "a" / "last.pt", tmp_path / "b" / "last.pt")
    # another seed gives other numbers: the comparison above can fail
    c = run_training(replace(a, out=str(tmp_path / "c"), seed=1))
    assert [h["train_loss"] for h in c["history"]] != [h["train_loss"] for h in sa["history"]]


def test_lr_schedule_is_defined_over_steps() -> None:
    cfg = TrainConfig(lr=1.0, lr_min_ratio=0.1, warmup_steps=4)
    lrs = [train_mod.lr_at(cfg, s, 25) for s in range(25)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0)  # the cosine part starts at the peak
    assert lrs[14] == pytest.approx(0.55)  # half-way: cos(pi/2) = 0, halfway to the floor
    assert lrs[-1] == pytest.approx(0.1)  # the last step reaches the floor
    assert all(x >= y for x, y in itertools.pairwise(lrs[3:]))


def test_time_budget_becomes_a_recorded_step_count(toy_dict: Path, tmp_path: Path) -> None:
    cfg = tiny_config(toy_dict, tmp_path / "t", steps=None, time_budget=0.02, eval_every=5)
    summary = run_training(cfg)
    budget = summary["budget"]
    assert budget["time_budget_min"] == 0.02 and budget["seconds_per_step"] > 0
    assert summary["steps"] == budget["steps"] >= 1
    stored = load_checkpoint(tmp_path / "t" / "last.pt")["train_config"]
    assert stored["steps"] == summary["steps"] and stored["time_budget"] == 0.02
    # the warm-up leaves the random state alone: a --steps run with that count is the same
    again = run_training(replace(cfg, out=str(tmp_path / "s"), steps=summary["steps"]))
    assert [h["train_loss"] for h in again["history"]] == [
        h["train_loss"] for h in summary["history"]
    ]


def test_weight_averaging_is_the_mean_of_the_last_steps(toy_dict: Path, tmp_path: Path) -> None:
    cfg = tiny_config(toy_dict, tmp_path / "avg", steps=6, average_last=0.5, ckpt_every=1)
    snapshots = []
    real = train_mod._Run.step

    def record(self: train_mod._Run, idx: list[int], lr: float) -> tuple[int, float]:
        out = real(self, idx, lr)
        snapshots.append(
            {k: v.detach().clone().double() for k, v in self.model.state_dict().items()}
        )
        return out

    with pytest.MonkeyPatch.context() as m:
        m.setattr(train_mod._Run, "step", record)
        run_training(cfg)
    ckpt = load_checkpoint(tmp_path / "avg" / "last.pt")
    assert ckpt["state"]["averaged_steps"] == 3
    for k, v in ckpt["averaged"].items():
        expected = sum(s[k] for s in snapshots[3:]) / 3
        torch.testing.assert_close(v.double(), expected, rtol=1e-5, atol=1e-6, msg=k)
    model, *_ = load_model(tmp_path / "avg" / "last.pt")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ckpt["averaged"][k])
