"""The bench's Hugging Face row (issue 18): a tiny Llama trained one step with the attention
implementation ``"attnscore"`` against the same model with ``"sdpa"``.

The model is built from a config (random weights, no download), with grouped-query heads
and a batch padded on the left, as a tokenizer pads one for a decoder. Without transformers
(the ``[hf]`` extra) the row is measured as nothing: a note says why, no verdict.
"""

from __future__ import annotations

import importlib.util

import torch

from ._core import Built, Forward, Shapes, lengths

LLAMA: Shapes = {"B": 8, "n": 256, "E": 256, "H": 8, "layers": 4}
"""Shapes of the full run: batch, tokens, hidden size, query heads, decoder layers."""

LLAMA_QUICK: Shapes = {"B": 2, "n": 32, "E": 64, "H": 4, "layers": 2}
"""Shapes of the smoke run (``--quick``)."""

MISSING = "hf_llama not measured: transformers is not installed (pip install 'attnscore[hf]')"


def available() -> bool:
    """Whether transformers can be imported."""
    return importlib.util.find_spec("transformers") is not None


def padded_batch(B: int, n: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Input ids (B, n) and their attention mask, left padded to lengths uniform in [1, n]."""
    valid_lens = lengths(B, n)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, vocab, (B, n), generator=gen)
    keep = torch.arange(n)[None, :] >= (n - valid_lens)[:, None]
    ids = ids.masked_fill(~keep, 0)
    return ids.to(device), keep.long().to(device)


def llama(s: Shapes, *, device: torch.device) -> Built:
    """The tiny Llama's forward + backward with ``"attnscore"`` and with ``"sdpa"``, same
    weights, same padded batch."""
    if not available():
        return Built({}, notes=[MISSING])
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..integrations.transformers import register

    register()
    B, n, E, H = s["B"], s["n"], s["E"], s["H"]
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=E,
        intermediate_size=4 * E,
        num_hidden_layers=s["layers"],
        num_attention_heads=H,
        num_key_value_heads=H // 2,
        max_position_embeddings=n,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    models: dict[str, torch.nn.Module] = {}
    for name in ("attnscore", "sdpa"):
        torch.manual_seed(0)  # the same weights in both
        model = LlamaForCausalLM(config)
        model.set_attn_implementation(name)
        module: torch.nn.Module = model  # (transformers types its .to for PreTrainedModel)
        models[name] = module.to(device).train()  # dropout 0: train = eval's numbers
    ids, attention_mask = padded_batch(B, n, config.vocab_size, device)

    def forward(model: torch.nn.Module) -> Forward:
        return lambda: model(input_ids=ids, attention_mask=attention_mask).logits

    return Built(
        {name: forward(model) for name, model in models.items()},
        {name: list(model.parameters()) for name, model in models.items()},
        same=("sdpa",),
        notes=[
            f"hf_llama: LlamaForCausalLM from a config (hidden {E}, {s['layers']} layers, "
            f"{H} heads, {H // 2} key/value heads), B={B}, n={n}, left padded; attnscore = "
            'attn_implementation="attnscore", sdpa = "sdpa"'
        ],
    )
