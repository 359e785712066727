from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from attnscore.registry import scorer_names
from attnscore_g2p import train as train_mod
from attnscore_g2p.budget import steps_for_time_budget
from attnscore_g2p.checkpoint import load_checkpoint, load_model
from attnscore_g2p.config import ModelConfig, TrainConfig
from attnscore_g2p.data import BOS_ID, EOS_ID, PAD_ID, encode_words, make_batch, split_of
from attnscore_g2p.dataset import prepare_data
from attnscore_g2p.evaluate import evaluate, predict
from attnscore_g2p.model import G2PModel
from attnscore_g2p.schedule import lr_at
from attnscore_g2p.stepper import Stepper, build_model
from attnscore_g2p.summary import RunSummary
from attnscore_g2p.train import run_training

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
        warmup_steps=0,
        average_last=0.0,
    )
    return replace(cfg, **kw)  # type: ignore[arg-type]


def mean_loss(model: nn.Module, cfg: TrainConfig) -> float:
    data = prepare_data(cfg, report=False)
    batch = make_batch(data.train_pairs, data.letters, data.phones)
    model.eval()
    with torch.no_grad():
        logits = model(batch.src, batch.valid_lens, batch.tgt_in)
    return float(
        nn.functional.cross_entropy(
            logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=PAD_ID
        )
    )


def params(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path).model


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
    assert summary.steps > 0 and summary.parameters > 0
    assert RunSummary.read(tmp_path / scoring) == summary  # summary.json round-trips
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
    assert summary.history and summary.best_valid_wer is not None
    data = prepare_data(cfg, report=False)
    res = evaluate(model, data.splits["train"], letters, phones)
    assert res.per < 0.5  # the toy language is regular: the model must be learning it
    # beam search with one beam is greedy decoding; a wider beam decodes every word too
    words = sorted(data.splits["train"])[:40]
    src, lengths = encode_words(words, letters)
    ids_g, att_g = model.greedy(src, lengths)
    ids_b, att_b = model.beam_search(src, lengths, beam=1)
    assert ids_g == ids_b
    for a, b in zip(att_g, att_b, strict=True):
        torch.testing.assert_close(a, b)
    ids_5, att_5 = model.beam_search(src, lengths, beam=5)
    assert len(ids_5) == len(words)
    assert all(a.shape == (len(i) + 1, len(w)) for i, a, w in zip(ids_5, att_5, words, strict=True))
    assert evaluate(model, data.splits["train"], letters, phones, beam=4).per < 0.5


class _KilledError(Exception):
    pass


def _fail_at(monkeypatch: pytest.MonkeyPatch, step: int, exc: type[BaseException]) -> None:
    real = Stepper.step
    calls = {"n": 0}

    def step_or_fail(self: Stepper, idx: list[int], lr: float) -> tuple[int, float]:
        calls["n"] += 1
        if calls["n"] == step:
            raise exc()
        return real(self, idx, lr)

    monkeypatch.setattr(Stepper, "step", step_or_fail)


def test_resume_after_ctrl_c_and_after_kill(
    toy_dict: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # dropout > 0: resuming must also restore the random number generator
    ref = tiny_config(toy_dict, tmp_path / "ref", dropout=0.2)
    run_training(ref)

    # (run, failing step, error, the step the checkpoint then holds): Ctrl-C at step 8
    # (mid-epoch) writes the checkpoint on the way out; a killed process saves nothing, so
    # the step-5 checkpoint is used
    for run, step, error, saved in (
        ("ctrlc", 8, KeyboardInterrupt, 7),
        ("killed", 9, _KilledError, 5),
    ):
        cfg = replace(ref, out=str(tmp_path / run))
        with monkeypatch.context() as m:
            _fail_at(m, step, error)
            with pytest.raises(error):
                run_training(cfg)
        assert load_checkpoint(tmp_path / run / "last.pt").state.step == saved
        run_training(cfg, resume=True)
        assert_same_params(tmp_path / "ref" / "last.pt", tmp_path / run / "last.pt")


def test_two_process_ddp_equals_one_process(toy_dict: Path, tmp_path: Path) -> None:
    # batch 15: odd global batches and a last batch of 1 example (rank 1 gets none) included
    one = tiny_config(
        toy_dict, tmp_path / "one", dropout=0.0, batch_size=15, steps=15, ckpt_every=0
    )
    run_training(one)
    # train() with nprocs=2 spawns the processes and returns rank 0's summary
    summary = train_mod.train(replace(one, out=str(tmp_path / "two"), nprocs=2))
    assert summary is not None and summary.world_size == 2 and summary.steps == 15
    assert (
        load_checkpoint(tmp_path / "two" / "last.pt").state.step
        == load_checkpoint(tmp_path / "one" / "last.pt").state.step
    )
    assert_same_params(tmp_path / "one" / "last.pt", tmp_path / "two" / "last.pt", atol=1e-5)


def test_same_command_and_seed_give_identical_numbers(toy_dict: Path, tmp_path: Path) -> None:
    # dropout > 0 and periodic validation: every source of randomness is seeded
    a = tiny_config(toy_dict, tmp_path / "a", eval_every=7, threads=1)
    b = replace(a, out=str(tmp_path / "b"))
    sa, sb = run_training(a), run_training(b)
    assert len(sa.history) == 4

    def numbers(summary: RunSummary) -> list[tuple[float, ...]]:
        return [(h.step, h.train_loss, h.valid_per, h.valid_wer) for h in summary.history]

    assert numbers(sa) == numbers(sb)
    assert_same_params(tmp_path / "a" / "last.pt", tmp_path / "b" / "last.pt")
    # another seed gives other numbers: the comparison above can fail
    c = run_training(replace(a, out=str(tmp_path / "c"), seed=1))
    assert [h.train_loss for h in c.history] != [h.train_loss for h in sa.history]


def test_lr_schedule_is_defined_over_steps() -> None:
    cfg = TrainConfig(lr=1.0, lr_min_ratio=0.1, warmup_steps=4)
    lrs = [lr_at(cfg, s, 25) for s in range(25)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0)  # the cosine part starts at the peak
    assert lrs[14] == pytest.approx(0.55)  # half-way: cos(pi/2) = 0, halfway to the floor
    assert lrs[-1] == pytest.approx(0.1)  # the last step reaches the floor
    assert all(x >= y for x, y in itertools.pairwise(lrs[3:]))


def test_time_budget_becomes_a_recorded_step_count(toy_dict: Path, tmp_path: Path) -> None:
    cfg = tiny_config(toy_dict, tmp_path / "t", steps=None, time_budget=0.02, eval_every=5)
    summary = run_training(cfg)
    budget = summary.budget
    assert budget.time_budget_min == 0.02 and (budget.seconds_per_step or 0) > 0
    assert summary.steps == budget.steps >= 1
    stored = load_checkpoint(tmp_path / "t" / "last.pt").config
    assert stored.steps == summary.steps and stored.time_budget == 0.02
    # the warm-up leaves the random state alone: a --steps run with that count is the same
    again = run_training(replace(cfg, out=str(tmp_path / "s"), steps=summary.steps))
    assert [h.train_loss for h in again.history] == [h.train_loss for h in summary.history]
    assert again.budget.seconds_per_step is None  # given steps: nothing measured


def test_weight_averaging_is_the_mean_of_the_last_steps(toy_dict: Path, tmp_path: Path) -> None:
    cfg = tiny_config(toy_dict, tmp_path / "avg", steps=6, average_last=0.5, ckpt_every=1)
    snapshots = []
    real = Stepper.step

    def record(self: Stepper, idx: list[int], lr: float) -> tuple[int, float]:
        out = real(self, idx, lr)
        snapshots.append(
            {k: v.detach().clone().double() for k, v in self.model.state_dict().items()}
        )
        return out

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Stepper, "step", record)
        run_training(cfg)
    ckpt = load_checkpoint(tmp_path / "avg" / "last.pt")
    assert ckpt.state.averaged_steps == 3 and ckpt.averaged is not None
    for k, v in ckpt.averaged.items():
        expected = sum(s[k] for s in snapshots[3:]) / 3
        torch.testing.assert_close(v.double(), expected, rtol=1e-5, atol=1e-6, msg=k)
    model, *_ = load_model(tmp_path / "avg" / "last.pt")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ckpt.averaged[k])


@pytest.mark.parametrize("input_feeding", [False, True], ids=["plain", "input-feeding"])
def test_teacher_forcing_equals_step_by_step_decoding(input_feeding: bool) -> None:
    """The teacher-forced forward (what training optimises) gives the logits that decoding
    computes one step at a time, and greedy decoding follows their argmax."""
    torch.manual_seed(0)
    cfg = ModelConfig(emb=6, enc_hidden=5, dec_hidden=7, dropout=0.0, input_feeding=input_feeding)
    model = G2PModel(cfg, n_letters=9, n_phones=11).eval()
    src = torch.tensor([[4, 5, 6, 7], [8, 4, 0, 0], [5, 0, 0, 0]])
    lengths = torch.tensor([4, 2, 1])
    tgt_in = torch.tensor([[BOS_ID, 4, 5, 9], [BOS_ID, 10, 6, 6], [BOS_ID, 7, 8, 4]])
    with torch.no_grad():
        logits = model(src, lengths, tgt_in)
        enc = model.encode(src, lengths)
        state, feed = enc.state, enc.state.new_zeros(3, cfg.dec_hidden)
        steps = []
        for t in range(tgt_in.shape[1]):
            step_logits, state, feed = model.step(tgt_in[:, t], state, feed, enc)
            steps.append(step_logits)
    assert logits.shape == (3, 4, 11)
    torch.testing.assert_close(logits, torch.stack(steps, 1), atol=1e-6, rtol=1e-5)

    ids, _ = model.greedy(src, lengths, max_len=4)
    for b, seq in enumerate(ids):  # fed its own output, each step's argmax is what it emitted
        fed = torch.tensor([[BOS_ID, *seq]])
        with torch.no_grad():
            again = model(src[b : b + 1, : int(lengths[b])], lengths[b : b + 1], fed)
        emitted = again[0].argmax(-1).tolist()
        assert emitted[: len(seq)] == seq and (len(seq) == 4 or emitted[len(seq)] == EOS_ID)


def test_model_input_checks() -> None:
    model = G2PModel(ModelConfig(emb=4, enc_hidden=4, dec_hidden=4), 6, 6)
    with pytest.raises(
        ValueError, match=r"Expected src \(B, S\) and valid_lens \(B,\), but got \(3,\)"
    ):
        model.encode(torch.tensor([4, 5, 4]), torch.tensor([3]))
    with pytest.raises(ValueError, match=r"Expected beam >= 1, but got 0"):
        model.beam_search(torch.tensor([[4, 5]]), torch.tensor([2]), beam=0)


def _lexicon_with_malformed_lines(path: Path, bad: int) -> None:
    good = ["abba AE1 B B AE1", "mosk M OW1 S K", "sade S AE1 D IY0", "boa B OW1 AE1"]
    path.write_text("\n".join([*good, *(f"word{i}" for i in range(bad))]) + "\n")


def test_prepare_data_reports_malformed_lines_and_trims_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "lex.dict"
    _lexicon_with_malformed_lines(data, bad=23)
    cfg = tiny_config(data, tmp_path / "out")
    full = prepare_data(cfg)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 21 and err[0].startswith("warning: line 5 skipped: Expected a word and")
    assert err[19].startswith("warning: line 24 skipped") and err[20] == (
        "warning: 3 more malformed lines"
    )
    assert prepare_data(cfg, report=False) and capsys.readouterr().err == ""
    trimmed = prepare_data(replace(cfg, max_train_words=2), report=False)
    assert sorted(trimmed.splits["train"]) == sorted(full.splits["train"])[:2]
    assert [w for w, _ in trimmed.train_pairs] == sorted(full.splits["train"])[:2]


def test_data_and_budget_that_cannot_be_trained_on(tmp_path: Path) -> None:
    held_out = next(w for w in (f"word{i}" for i in itertools.count()) if split_of(w) != "train")
    data = tmp_path / "one.dict"
    data.write_text(f"{held_out} W ER1 D\n")
    with pytest.raises(ValueError, match="Expected a non-empty training split"):
        prepare_data(tiny_config(data, tmp_path / "out"))
    with pytest.raises(ValueError, match="Expected a budget"):
        run_training(tiny_config(data, tmp_path / "out", steps=None))


def test_clip_zero_means_no_clipping(toy_dict: Path, tmp_path: Path) -> None:
    def trained(clip: float) -> dict[str, torch.Tensor]:
        cfg = tiny_config(toy_dict, tmp_path, clip=clip, dropout=0.0)
        data = prepare_data(cfg, report=False)
        torch.manual_seed(0)
        run = Stepper(cfg, data, 0, 1)
        for idx in ([0, 5, 9, 20], [1, 2, 3]):
            run.step(idx, lr=0.1)
        return run.model.state_dict()

    free, loose, tight = trained(0.0), trained(1e9), trained(1e-3)
    for k in free:
        torch.testing.assert_close(free[k], loose[k], rtol=0, atol=0, msg=k)
    assert any(not torch.equal(free[k], tight[k]) for k in free)


def test_time_budget_without_validation_times_steps_only(toy_dict: Path, tmp_path: Path) -> None:
    cfg = tiny_config(toy_dict, tmp_path, steps=None, time_budget=0.01, eval_every=0)
    data = prepare_data(cfg, report=False)
    rng = torch.get_rng_state()
    budget = steps_for_time_budget(cfg, data)
    assert budget.seconds_per_validation == 0.0 and (budget.seconds_per_step or 0) > 0
    assert budget.steps >= 1 and torch.equal(torch.get_rng_state(), rng)
    with pytest.raises(ValueError, match="Expected a configuration with a time budget"):
        steps_for_time_budget(replace(cfg, time_budget=None), data)


@pytest.mark.parametrize("scoring", ["additive", "cosine"])
def test_attention_weights_get_the_model_dropout(scoring):
    """The model's dropout applies to the attention weights too (as before the registry):
    in training mode the pooled output is random (and scaled up where kept), in eval mode
    it is the plain weighted average of the values."""
    torch.manual_seed(0)
    cfg = ModelConfig(scoring=scoring, emb=6, enc_hidden=8, dec_hidden=8, dropout=0.5)
    model = G2PModel(cfg, n_letters=9, n_phones=11)
    q, k, v = torch.randn(4, 3, 8), torch.randn(4, 20, 8), torch.randn(4, 20, 8)
    lengths = torch.full((4,), 20)
    model.attention.eval()
    plain = model.attention(q, k, v, lengths)
    torch.testing.assert_close(plain, model.attention.attention_weights @ v)
    model.attention.train()
    first, second = model.attention(q, k, v, lengths), model.attention(q, k, v, lengths)
    assert not torch.allclose(first, plain) and not torch.allclose(first, second)


def test_keep_freed_memory_reuses_freed_blocks() -> None:
    """With the thresholds raised, a freed 4 MiB block comes back at the same address;
    glibc's default unmaps it on free and serves the next one elsewhere. In a fresh
    process, so that nothing before has moved glibc's own dynamic threshold (the module is
    loaded by its path: it needs nothing but ctypes, so torch is not imported)."""
    import subprocess
    import sys

    from attnscore import _memory

    code = """if True:
        import ctypes, importlib.util, sys
        if sys.argv[1] == "keep":
            spec = importlib.util.spec_from_file_location("_memory", sys.argv[2])
            memory = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(memory)
            if not memory.keep_freed_memory():
                print("no-glibc"); raise SystemExit
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        first = libc.malloc(4 << 20); libc.free(first)
        second = libc.malloc(4 << 20); libc.free(second)
        print(first == second)
    """
    runs = {
        mode: subprocess.run(
            [sys.executable, "-c", code, mode, _memory.__file__],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()[-1]
        for mode in ("keep", "default")
    }
    if runs["keep"] == "no-glibc":
        pytest.skip("not glibc")
    assert runs == {"keep": "True", "default": "False"}


def test_enc_layers_option_builds_a_deeper_encoder(toy_dict: Path, tmp_path: Path) -> None:
    from attnscore_g2p._handlers import train_config
    from attnscore_g2p.cli import build_parser

    args = build_parser().parse_args(
        ["train", "--data", str(toy_dict), "--out", str(tmp_path), "--enc-layers", "2"]
    )
    cfg = train_config(args)
    assert cfg.model.enc_layers == 2
    model = G2PModel(cfg.model, n_letters=9, n_phones=11)
    assert model.encoder.num_layers == 2 and model.encoder.bidirectional


def test_bfloat16_precision_runs_the_forward_in_bfloat16_with_float32_weights(
    toy_dict: Path, tmp_path: Path
) -> None:
    def first_step(precision: str) -> tuple[float, list[torch.dtype], Stepper]:
        cfg = tiny_config(toy_dict, tmp_path, dropout=0.0, precision=precision)
        data = prepare_data(cfg, report=False)
        torch.manual_seed(0)
        run = Stepper(cfg, data, 0, 1)
        seen: list[torch.dtype] = []
        run.model.out.register_forward_hook(lambda _m, _a, out: seen.append(out.dtype))
        _, loss = run.step([0, 5, 9, 20], lr=1e-2)
        return loss, seen, run

    loss32, seen32, _ = first_step("float32")
    loss16, seen16, run = first_step("bfloat16")
    assert seen32 == [torch.float32] and seen16 == [torch.bfloat16]
    # the loss of the same weights and batch, to bfloat16 rounding (8 bits of mantissa)
    assert loss16 == pytest.approx(loss32, rel=2e-2)
    params = list(run.model.parameters())
    assert all(p.dtype == torch.float32 and p.grad is not None for p in params)
    assert all(p.grad.dtype == torch.float32 for p in params if p.grad is not None)
    with pytest.raises(ValueError, match=r"precision to be one of float32, bfloat16.*'float16'"):
        TrainConfig(precision="float16")
