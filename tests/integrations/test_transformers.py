"""attnscore as a Hugging Face transformers attention implementation (issue 18, part 1).

Tiny models built from configs (random weights, float32, seeded, no downloads): a
grouped-query Llama and a BERT, on a batch with left and right padding. "attnscore" must
compute what "sdpa" computes; the sparse names must give sparse rows that sum to 1 and
train. The attention function itself is checked against a float64 textbook reference and
against transformers' own ``sdpa_attention_forward``.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AttentionInterface,
    AttentionMaskInterface,
    AutoModelForCausalLM,
    BertConfig,
    BertModel,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import sdpa_mask  # noqa: E402

from attnscore.integrations.transformers import (  # noqa: E402
    DEFAULT_NORMALIZERS,
    attention_function,
    register,
)

NAMES = ["attnscore", "attnscore_sparsemax", "attnscore_entmax15"]
B, N = 3, 10


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    assert register() == NAMES


def _padded_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids (B, N) and an attention mask with no padding (row 0), left padding
    (row 1: 3 pads) and right padding (row 2: 4 pads)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (B, N), generator=g)
    attention_mask = torch.ones(B, N, dtype=torch.long)
    attention_mask[1, :3] = 0
    attention_mask[2, 6:] = 0
    ids[attention_mask == 0] = 0
    return ids, attention_mask


def _llama(initializer_range: float = 0.02, vocab: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=initializer_range,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    return _llama()


@pytest.fixture(scope="module")
def bert() -> BertModel:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    return BertModel(config, add_pooling_layer=False).eval()


def _run(model: torch.nn.Module, impl: str, **inputs: object) -> object:
    model.set_attn_implementation(impl)
    assert model.config._attn_implementation == impl
    with torch.no_grad():
        return model(**inputs)


# --- whole models ------------------------------------------------------------------


def test_llama_logits_equal_sdpa(llama: LlamaForCausalLM) -> None:
    ids, attention_mask = _padded_batch(64)
    expected = _run(llama, "sdpa", input_ids=ids, attention_mask=attention_mask).logits
    logits = _run(llama, "attnscore", input_ids=ids, attention_mask=attention_mask).logits
    assert torch.isfinite(logits).all()  # padded positions included
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=1e-5)


def test_llama_without_padding_equals_sdpa(llama: LlamaForCausalLM) -> None:
    # No mask reaches the attention function: causal masking by `is_causal` alone.
    ids, _ = _padded_batch(64)
    expected = _run(llama, "sdpa", input_ids=ids).logits
    torch.testing.assert_close(_run(llama, "attnscore", input_ids=ids).logits, expected)


def test_llama_from_config_takes_the_name() -> None:
    config = _llama().config
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attnscore_entmax15")
    assert model.config._attn_implementation == "attnscore_entmax15"


def test_bert_hidden_states_equal_sdpa(bert: BertModel) -> None:
    ids, attention_mask = _padded_batch(64)
    expected = _run(bert, "sdpa", input_ids=ids, attention_mask=attention_mask)
    hidden = _run(bert, "attnscore", input_ids=ids, attention_mask=attention_mask)
    out = hidden.last_hidden_state
    assert torch.isfinite(out).all()
    real = attention_mask.bool()
    torch.testing.assert_close(out[real], expected.last_hidden_state[real], rtol=0, atol=1e-5)


def test_generate_gives_the_same_greedy_tokens(llama: LlamaForCausalLM) -> None:
    ids, attention_mask = _padded_batch(64)
    ids, attention_mask = ids[:2], attention_mask[:2]  # no padding, left padding
    tokens = {}
    for impl in ("sdpa", "attnscore"):
        llama.set_attn_implementation(impl)
        tokens[impl] = llama.generate(
            input_ids=ids,
            attention_mask=attention_mask,
            max_new_tokens=20,
            min_new_tokens=20,
            do_sample=False,
            pad_token_id=0,
        )
    assert tokens["attnscore"].shape == (2, N + 20)
    assert torch.equal(tokens["attnscore"], tokens["sdpa"])


def test_output_attentions_rows_and_padding(llama: LlamaForCausalLM) -> None:
    ids, attention_mask = _padded_batch(64)
    inputs = {"input_ids": ids, "attention_mask": attention_mask, "output_attentions": True}
    eager = _run(llama, "eager", **inputs).attentions
    ours = _run(llama, "attnscore", **inputs).attentions
    real = attention_mask.bool()
    assert len(ours) == 2
    for weights, expected in zip(ours, eager, strict=True):
        assert weights.shape == (B, 4, N, N)
        assert torch.isfinite(weights).all()
        rows = weights.sum(-1).permute(0, 2, 1)  # (B, N, H)
        torch.testing.assert_close(rows[real], torch.ones_like(rows[real]))
        # Padded keys: exact zeros for every query; left-padded queries see no key: zeros.
        assert (weights.permute(0, 3, 1, 2)[~real] == 0).all()
        assert (weights[1, :, :3] == 0).all()
        at_real = weights.permute(0, 2, 1, 3)[real]
        torch.testing.assert_close(at_real, expected.permute(0, 2, 1, 3)[real], rtol=0, atol=1e-6)
    assert _run(llama, "attnscore", input_ids=ids).attentions is None


# --- sparse normalizers ------------------------------------------------------------


@pytest.mark.parametrize("name", ["attnscore_entmax15", "attnscore_sparsemax"])
def test_sparse_rows_sum_to_one_with_exact_zeros(name: str) -> None:
    pytest.importorskip("entmax")
    model = _llama(initializer_range=0.2)  # scores spread enough to be sparse
    ids, attention_mask = _padded_batch(64)
    model.set_attn_implementation(name)
    out = model(input_ids=ids, attention_mask=attention_mask, output_attentions=True)
    real = attention_mask.bool()
    allowed = torch.ones(N, N, dtype=torch.bool).tril() & real[:, None, None, :]
    for weights in out.attentions:
        assert torch.isfinite(weights).all()
        rows = weights.sum(-1).permute(0, 2, 1)
        torch.testing.assert_close(rows[real], torch.ones_like(rows[real]))
        assert (weights.masked_select(~allowed) == 0).all()
        assert (weights.masked_select(allowed) == 0).any()  # sparse among allowed keys too
    labels = ids.masked_fill(~real, -100)
    model.zero_grad()
    model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_entmax15_trains_a_copy_task() -> None:
    pytest.importorskip("entmax")
    vocab, length, batch = 16, 6, 32
    model = _llama(vocab=vocab)
    model.set_attn_implementation("attnscore_entmax15")
    g = torch.Generator().manual_seed(2)

    def copy_batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(3, vocab, (batch, length), generator=g)
        ids = torch.cat(
            [torch.ones(batch, 1, dtype=torch.long), x, 2 * torch.ones_like(x[:, :1]), x], 1
        )
        labels = ids.clone()
        labels[:, : length + 2] = -100  # the loss is on the copy only
        return ids, labels

    held_out = copy_batch()

    def held_out_loss() -> float:
        model.eval()
        with torch.no_grad():
            return float(model(input_ids=held_out[0], labels=held_out[1]).loss)

    before = held_out_loss()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(30):
        ids, labels = copy_batch()
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = held_out_loss()
    assert after < 0.6 * before, (before, after)


# --- the attention function against references -------------------------------------


def _module(**attributes: object) -> types.SimpleNamespace:
    defaults: dict[str, object] = {"training": False, "is_causal": True, "num_key_value_groups": 2}
    return types.SimpleNamespace(**{**defaults, **attributes})


def _reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook attention in float64: repeat the key/value heads, mask with -inf, rows with
    no allowed key give zeros; returns (output (B, n, H, dv), weights (B, H, n, m))."""
    groups = query.shape[1] // key.shape[1]
    q, k, v = (t.double() for t in (query, key, value))
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.mT * scaling
    if allowed is None:
        allowed = torch.ones(scores.shape, dtype=torch.bool)
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    weights = torch.where(allowed, weights, 0.0).nan_to_num(0.0)
    return (weights @ v).transpose(1, 2), weights


def _qkv(n: int, m: int, H: int = 4, H_kv: int = 2, d: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    return (
        torch.randn(2, H, n, d, generator=g),
        torch.randn(2, H_kv, m, d, generator=g),
        torch.randn(2, H_kv, m, d, generator=g),
    )


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-6)


def test_prefill_is_causal_without_a_mask() -> None:
    q, k, v = _qkv(5, 5)
    fn = attention_function()
    out, weights = fn(_module(), q, k, v, None, scaling=0.3, output_attentions=True)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    expected, expected_weights = _reference(q, k, v, causal, 0.3)
    assert out.shape == (2, 5, 4, 8) and out.is_contiguous()
    _close(out, expected)
    _close(weights, expected_weights)
    sdpa, _ = sdpa_attention_forward(_module(), q, k, v, None, scaling=0.3)
    torch.testing.assert_close(out, sdpa)
    # `is_causal` in the call wins over the module's; a module without one is causal.
    bidirectional, _ = fn(_module(), q, k, v, None, scaling=0.3, is_causal=False)
    _close(bidirectional, _reference(q, k, v, None, 0.3)[0])
    no_attribute = types.SimpleNamespace(training=False)
    torch.testing.assert_close(fn(no_attribute, q, k, v, None, scaling=0.3)[0], out)


def test_prefill_into_a_longer_cache_is_top_left_causal() -> None:
    # What sdpa_mask leaves to `is_causal` when a static cache is filled from position 0.
    q, k, v = _qkv(4, 7)
    out, _ = attention_function()(_module(), q, k, v, None, scaling=0.25)
    expected, _ = sdpa_attention_forward(_module(), q, k, v, None, scaling=0.25)
    torch.testing.assert_close(out, expected)


def test_boolean_mask_with_fully_masked_rows() -> None:
    q, k, v = _qkv(5, 6, H=2, H_kv=2)
    allowed = torch.ones(2, 1, 5, 6, dtype=torch.bool).tril(1)
    allowed[1, :, :, :2] = False  # left padding: row 0 of example 1 may attend nothing
    k[1, :, :2] = float("nan")  # padded keys and values hold garbage
    v[1, :, :2] = float("nan")
    fn = attention_function()
    out, weights = fn(_module(num_key_value_groups=1), q, k, v, allowed, output_attentions=True)
    expected, expected_weights = _reference(q, k.nan_to_num(), v.nan_to_num(), allowed, 8**-0.5)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    assert (out[1, 0] == 0).all() and (weights[1, :, 0] == 0).all()
    _close(out, expected)
    _close(weights, expected_weights)
    # No mask and is_causal ignored when a mask is given (the mask says everything).
    again, _ = fn(_module(num_key_value_groups=1), q, k, v, allowed, is_causal=True)
    torch.testing.assert_close(again, out)


@pytest.mark.parametrize("per_head", [False, True])
def test_decoding_one_query_against_a_longer_cache(per_head: bool) -> None:
    q, k, v = _qkv(1, 7)
    allowed = torch.ones(2, 4 if per_head else 1, 1, 7, dtype=torch.bool)
    allowed[1, ..., :3] = False
    if per_head:
        allowed[0, 1, 0, 5:] = False
    fn = attention_function()
    out, weights = fn(_module(), q, k, v, allowed, scaling=0.5, output_attentions=True)
    expected, expected_weights = _reference(q, k, v, allowed, 0.5)
    assert out.shape == (2, 1, 4, 8) and weights.shape == (2, 4, 1, 7)
    _close(out, expected)
    _close(weights, expected_weights)
    sdpa, _ = sdpa_attention_forward(_module(), q, k, v, allowed, scaling=0.5)
    torch.testing.assert_close(out, sdpa)
    # Without a mask one query attends the whole cache (no causal cut at key 0).
    unmasked, _ = fn(_module(), q, k, v, None, scaling=0.5)
    _close(unmasked, _reference(q, k, v, None, 0.5)[0])


def test_dropout_only_while_training() -> None:
    q, k, v = _qkv(5, 5)
    fn = attention_function()
    evaluated, _ = fn(_module(), q, k, v, None, dropout=0.5)
    torch.testing.assert_close(evaluated, fn(_module(), q, k, v, None)[0])
    torch.manual_seed(0)
    trained, _ = fn(_module(training=True), q, k, v, None, dropout=0.5)
    assert not torch.allclose(trained, evaluated)


def test_gradients_through_padding_are_finite() -> None:
    q, k, v = (t.requires_grad_() for t in _qkv(4, 4))
    allowed = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    allowed[1, :, :, :2] = False
    allowed[1, :, 0] = False
    out, weights = attention_function()(_module(), q, k, v, allowed, output_attentions=True)
    (out.sum() + weights.sum()).backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all()
    assert (q.grad[1, :, 0] == 0).all()  # a query that may attend nothing: zero gradient


# --- registration and errors -------------------------------------------------------


def test_register_is_idempotent() -> None:
    assert register() == NAMES
    assert register() == NAMES
    assert DEFAULT_NORMALIZERS == ("softmax", "sparsemax", "entmax15")
    for name, normalizer in zip(NAMES, DEFAULT_NORMALIZERS, strict=True):
        assert AttentionInterface()[name] is attention_function(normalizer)
        assert AttentionMaskInterface()[name] is sdpa_mask
    assert attention_function("softmax").__name__ == "attnscore_attention_forward"


def test_register_other_normalizers() -> None:
    assert register(["hardmax"]) == ["attnscore_hardmax"]
    assert register("softmax") == ["attnscore"]
    q, k, v = _qkv(3, 3)
    out, weights = attention_function("hardmax")(_module(), q, k, v, None, output_attentions=True)
    assert set(weights.unique().tolist()) <= {0.0, 1.0}
    _close(out, (weights.double() @ v.double().repeat_interleave(2, 1)).transpose(1, 2))


def test_unknown_normalizer() -> None:
    with pytest.raises(ValueError, match=r"Expected `normalizer` to be one of .*'nope' instead"):
        attention_function("nope")
    with pytest.raises(ValueError, match=r"Expected `normalizer` to be one of .*\['x'\] instead"):
        attention_function(["x"])  # type: ignore[arg-type]
    before = set(AttentionInterface().valid_keys())
    with pytest.raises(ValueError, match=r"Expected `normalizers` to hold names from .*'nope'"):
        register(["softmax", "nope"])
    assert set(AttentionInterface().valid_keys()) == before  # nothing half-registered


def test_bad_inputs_are_refused() -> None:
    q, k, v = _qkv(4, 4)
    fn = attention_function()
    integers = torch.ones(2, 1, 4, 4, dtype=torch.long)
    with pytest.raises(TypeError, match=r"Expected `attention_mask` .* got dtype torch.int64"):
        fn(_module(), q, k, v, integers)
    with pytest.raises(ValueError, match=r"Expected `attention_mask` of shape .* \(2, 4\)"):
        fn(_module(), q, k, v, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"Expected `position_bias` .* got dtype torch.bool"):
        fn(_module(), q, k, v, None, position_bias=torch.ones(1, 4, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"Expected `position_bias` of shape .* \(1, 4, 4, 3\)"):
        fn(_module(), q, k, v, None, position_bias=torch.zeros(1, 4, 4, 3))
    with pytest.raises(ValueError, match=r"Expected no `softcap`"):
        fn(_module(), q, k, v, None, softcap=30.0)
    with pytest.raises(ValueError, match=r"multiple of the key/value heads"):
        fn(_module(), q[:, :3], k, v, None)
    model = _llama()
    with pytest.raises(ValueError, match=r"attnscore_additive"):
        model.set_attn_implementation("attnscore_additive")  # not registered: no such name


def test_register_without_transformers_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'attnscore\[hf\]'"):
        register()


# --- float masks, score biases, weights on the autograd path, compile (issue 36) -------


def _biased_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor,
    allowed: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Textbook attention in float64 with ``bias`` added to the scores, then masked with
    -inf where ``allowed`` is False (rows with no allowed key: zeros); (B, n, H, dv)."""
    groups = query.shape[1] // key.shape[1]
    q, k, v = (t.double() for t in (query, key, value))
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.mT * scaling + bias.double()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, -1).nan_to_num(0.0)
    return (weights @ v).transpose(1, 2)


def _additive(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' float form of a boolean mask: 0 where allowed, the lowest value not."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


@pytest.mark.parametrize("n", [1, 5])
def test_float_4d_mask_equals_sdpa_and_the_reference(n: int) -> None:
    q, k, v = _qkv(n, 6)
    g = torch.Generator().manual_seed(4)
    allowed = torch.rand(2, 4, n, 6, generator=g) > 0.4
    allowed[..., 0] = True  # every query attends some key (a row of lowest values: uniform)
    mask = _additive(allowed)
    fn = attention_function()
    out, _ = fn(_module(), q, k, v, mask, scaling=0.4)
    _close(out, _reference(q, k, v, allowed, 0.4)[0])
    sdpa, _ = sdpa_attention_forward(_module(), q, k, v, mask, scaling=0.4)
    torch.testing.assert_close(out, sdpa)
    # A float mask is additive, as in "sdpa": any finite values, not only 0 and the lowest.
    soft = torch.randn(2, 1, n, 6, generator=g)
    out, weights = fn(_module(), q, k, v, soft, scaling=0.4, output_attentions=True)
    _close(out, _biased_reference(q, k, v, soft, None, 0.4))
    torch.testing.assert_close(
        out, sdpa_attention_forward(_module(), q, k, v, soft, scaling=0.4)[0]
    )
    assert weights.shape == (2, 4, n, 6)


@pytest.mark.parametrize("n", [1, 5])
def test_position_bias_equals_sdpa_and_the_reference(n: int) -> None:
    q, k, v = _qkv(n, 6, H=4, H_kv=4)
    module = _module(num_key_value_groups=1, is_causal=False)
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(1, 4, n, 6, generator=g)
    allowed = torch.ones(2, 1, n, 6, dtype=torch.bool)
    allowed[1, ..., 4:] = False  # right padding of example 1's keys
    fn = attention_function()
    for mask, expected_allowed in ((None, None), (allowed, allowed)):
        out, _ = fn(module, q, k, v, mask, scaling=1.0, position_bias=bias)
        _close(out, _biased_reference(q, k, v, bias, expected_allowed, 1.0))
        sdpa, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=1.0, position_bias=bias)
        torch.testing.assert_close(out, sdpa)
    # With a float mask the two are summed; causal without a mask, as "sdpa" does.
    out, _ = fn(module, q, k, v, _additive(allowed), scaling=1.0, position_bias=bias)
    _close(out, _biased_reference(q, k, v, bias, allowed, 1.0))
    causal = _module(num_key_value_groups=1, is_causal=True)
    out, _ = fn(causal, q, k, v, None, scaling=1.0, position_bias=bias)
    expected, _ = sdpa_attention_forward(causal, q, k, v, None, scaling=1.0, position_bias=bias)
    torch.testing.assert_close(out, expected)
    if n > 1:
        tril = torch.ones(n, 6, dtype=torch.bool).tril()
        _close(out, _biased_reference(q, k, v, bias, tril, 1.0))


def test_position_bias_gets_gradients_and_padded_queries_stay_zero() -> None:
    q, k, v = _qkv(4, 4, H=4, H_kv=4)
    bias = torch.randn(1, 4, 4, 4, requires_grad=True)
    allowed = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    allowed[1, :, 0] = False  # a query that may attend nothing
    module = _module(num_key_value_groups=1)
    out, weights = attention_function()(
        module, q, k, v, allowed, position_bias=bias, output_attentions=True
    )
    assert (out[1, 0] == 0).all() and (weights[1, :, 0] == 0).all()
    (grad,) = torch.autograd.grad(out.square().sum(), bias)
    b64 = bias.detach().double().requires_grad_()
    expected = _biased_reference(q, k, v, b64, allowed, 8**-0.5)
    (expected_grad,) = torch.autograd.grad(expected.square().sum(), b64)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-4, atol=1e-6)


def test_custom_4d_mask_in_a_llama(llama: LlamaForCausalLM) -> None:
    # As transformers' test_custom_4d_attention_mask: two sequences sharing a prefix,
    # packed into one with a float 4-D mask (the second continuation does not see the
    # first) and restarted positions, give the logits of the two sequences run alone.
    g = torch.Generator().manual_seed(6)
    prefix, first, second = (torch.randint(3, 64, (1, size), generator=g) for size in (4, 2, 2))
    packed = torch.cat([prefix, first, second], 1)
    allowed = torch.ones(8, 8, dtype=torch.bool).tril()
    allowed[6:, 4:6] = False
    mask = _additive(allowed)[None, None]
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 4, 5]])
    logits = {}
    for impl in ("sdpa", "attnscore"):
        logits[impl] = _run(
            llama, impl, input_ids=packed, attention_mask=mask, position_ids=positions
        )
    torch.testing.assert_close(logits["attnscore"].logits, logits["sdpa"].logits)
    alone = _run(llama, "sdpa", input_ids=torch.cat([prefix, first], 1)).logits
    torch.testing.assert_close(logits["attnscore"].logits[:, :6], alone, rtol=1e-4, atol=1e-5)
    alone = _run(llama, "sdpa", input_ids=torch.cat([prefix, second], 1)).logits
    torch.testing.assert_close(
        logits["attnscore"].logits[:, 6:], alone[:, 4:], rtol=1e-4, atol=1e-5
    )


def test_returned_attentions_are_on_the_autograd_path(llama: LlamaForCausalLM) -> None:
    # As transformers' test_retain_grad_hidden_states_attentions, and the gradients that
    # reach the inputs through the maps equal eager's (its softmax written out).
    ids, attention_mask = _padded_batch(64)
    embeds = llama.get_input_embeddings()(ids).detach()
    r = torch.randn(B, 4, N, N, generator=torch.Generator().manual_seed(7))
    r = r * attention_mask[:, None, :, None]  # padded queries: eager's weights are not zeros
    grads = {}
    for impl in ("eager", "attnscore"):
        llama.set_attn_implementation(impl)
        x = embeds.clone().requires_grad_()
        out = llama(
            inputs_embeds=x,
            attention_mask=attention_mask,
            output_attentions=True,
            output_hidden_states=True,
        )
        attentions, hidden = out.attentions[0], out.hidden_states[0]
        attentions.retain_grad()
        hidden.retain_grad()
        out.logits.flatten()[0].backward(retain_graph=True)
        assert attentions.grad is not None and attentions.grad.abs().sum() > 0
        assert hidden.grad is not None
        x.grad = None
        (out.attentions[1] * r).sum().backward()
        assert x.grad is not None
        grads[impl] = x.grad[attention_mask.bool()]
    assert grads["attnscore"].abs().sum() > 0
    torch.testing.assert_close(grads["attnscore"], grads["eager"], rtol=1e-4, atol=1e-6)


def _t5() -> transformers.T5ForConditionalGeneration:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config).eval()


def test_t5_equals_sdpa_with_its_position_bias() -> None:
    model = _t5()
    ids, attention_mask = _padded_batch(64)
    decoder_ids = torch.randint(3, 64, (B, 6), generator=torch.Generator().manual_seed(8))
    inputs = {
        "input_ids": ids,
        "attention_mask": attention_mask,
        "decoder_input_ids": decoder_ids,
        "labels": decoder_ids,
    }
    results = {}
    for impl in ("sdpa", "attnscore"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        out = model(**inputs)
        out.loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results[impl] = out, grads
    (ours, our_grads), (sdpa, sdpa_grads) = results["attnscore"], results["sdpa"]
    real = attention_mask.bool()
    torch.testing.assert_close(
        ours.encoder_last_hidden_state[real], sdpa.encoder_last_hidden_state[real]
    )
    torch.testing.assert_close(ours.logits, sdpa.logits)  # decoder: cross-attends padding
    assert our_grads.keys() == sdpa_grads.keys()
    bias_weights = [name for name in our_grads if "relative_attention_bias" in name]
    assert bias_weights and all(our_grads[name].abs().sum() > 0 for name in bias_weights)
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, sdpa_grads[name], rtol=1e-4, atol=1e-6)
    tokens = {}
    for impl in ("sdpa", "attnscore"):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(
            input_ids=ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False
        )
    assert torch.equal(tokens["attnscore"], tokens["sdpa"])


def test_fullgraph_compile_of_a_llama_with_attnscore() -> None:
    torch.manual_seed(0)
    config = _llama().config
    config.num_hidden_layers = 1
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("attnscore")
    ids, attention_mask = _padded_batch(64)
    allowed = torch.ones(N, N, dtype=torch.bool).tril()[None, None].repeat(B, 1, 1, 1)
    allowed[2, :, :, 6:] = False
    float_mask = _additive(allowed)

    def forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, attention_mask=mask).logits

    compiled = torch.compile(forward, backend="eager", fullgraph=True)
    with torch.no_grad():
        for mask, real in (
            (attention_mask, attention_mask.bool()),
            (float_mask, allowed.any(-1)[:, 0]),
        ):
            expected = forward(ids, mask)
            torch.testing.assert_close(compiled(ids, mask)[real], expected[real])
