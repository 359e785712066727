"""The G2P model as one ONNX graph: greedy decoding of a batch of words, for ONNX Runtime.

:class:`GreedyDecoder` is :meth:`G2PModel.greedy <attnscore_g2p.model.G2PModel.greedy>` as a
graph of fixed shape but for the batch: the encoder over words padded to ``max_letters``
letters (a BiGRU made of one GRU per direction over each word reversed within its length, so
that no packed sequence is needed), then ``max_letters + 10`` greedy decoder steps unrolled
(the model's own :meth:`~attnscore_g2p.model.G2PModel.step`, with its attention module,
which runs its plain formulation while exporting). :func:`export_greedy` exports it through
``torch.onnx.export(..., dynamo=True)`` with a dynamic batch size and stores the
vocabularies in the file's metadata, so that a program with ONNX Runtime and NumPy alone
pronounces words (``examples/g2p_onnx_decode.py``).

Shape legend: B words, L = ``max_letters``, T = L + 10 decoder steps, H the decoder's size.
"""

from __future__ import annotations

import json

import torch
from torch import Tensor, nn

from attnscore.integrations.export import onnx_export

from .data import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Vocab
from .model import Encoded, G2PModel

__all__ = ["EXTRA_STEPS", "METADATA_KEY", "GreedyDecoder", "export_greedy"]

#: Decoder steps beyond the longest word, as :meth:`G2PModel.greedy` decodes.
EXTRA_STEPS = 10
#: The key of the file's metadata entry (JSON: vocabularies and sizes); a name that files
#: exported before the move to attnscore-g2p carry too (examples/g2p_onnx_decode.py reads it).
METADATA_KEY = "attnscore.g2p"


def _by_index(x: Tensor, index: Tensor) -> Tensor:
    """x (B, L, F) reordered along L by index (B, L)."""
    return x.gather(1, index.unsqueeze(-1).expand_as(x))


class GreedyDecoder(nn.Module):
    """Greedy decoding of a :class:`~attnscore_g2p.model.G2PModel` in one traceable pass.

    ``forward(letters (B, L) int64, valid_lens (B,) int64) -> phonemes (B, T) int64``: the
    phoneme id the model emits at each of T = L + 10 steps (the ids after the first
    ``</s>`` are to be ignored: :meth:`G2PModel.greedy` stops there, and at
    ``max(valid_lens) + 10`` steps). Letters are padded with ``<pad>`` (0) to L; every
    length is at least 1.

    Args:
        model: the trained model (put in eval mode: dropout off).
        max_letters: L, the longest word the graph takes.

    Raises:
        ValueError: ``max_letters`` not a positive int.
    """

    def __init__(self, model: G2PModel, max_letters: int) -> None:
        super().__init__()
        if isinstance(max_letters, bool) or not isinstance(max_letters, int) or max_letters < 1:
            raise ValueError(
                f"Expected `max_letters` to be a positive int, but got {max_letters!r} instead."
            )
        self.model = model.eval()
        self.max_letters = max_letters
        self.steps = max_letters + EXTRA_STEPS

    def _direction(self, layer: int, suffix: str, x: Tensor) -> Tensor:
        """One direction of the encoder's ``layer`` over x (B, L, F), from a zero state."""
        gru = self.model.encoder
        names = ["weight_ih", "weight_hh"] + (["bias_ih", "bias_hh"] if gru.bias else [])
        params = [getattr(gru, f"{name}_l{layer}{suffix}") for name in names]
        h0 = x.new_zeros(1, x.shape[0], gru.hidden_size)
        out, _ = torch.gru(x, h0, params, gru.bias, 1, 0.0, False, False, True)
        return out

    def encode(self, letters: Tensor, valid_lens: Tensor) -> Encoded:
        """:meth:`G2PModel.encode` of padded words without packing: each word's backward
        direction reads it reversed within its length (padding stays behind it), so every
        state at a letter is the packed encoder's; states at padding are never attended."""
        model = self.model
        steps = torch.arange(letters.shape[1], device=letters.device)
        valid = steps < valid_lens.unsqueeze(-1)
        reverse = torch.where(valid, valid_lens.unsqueeze(-1) - 1 - steps, steps)
        x = model.src_emb(letters)
        forward = backward = x
        for layer in range(model.encoder.num_layers):
            forward = self._direction(layer, "", x)
            backward = _by_index(self._direction(layer, "_reverse", _by_index(x, reverse)), reverse)
            x = torch.cat([forward, backward], dim=-1)
        last = (valid_lens - 1).view(-1, 1, 1).expand(-1, 1, forward.shape[-1])
        final = torch.cat([forward.gather(1, last)[:, 0], backward[:, 0]], dim=-1)
        state = torch.tanh(model.init_proj(final)).unsqueeze(0)
        return Encoded(model.key_proj(x), valid_lens, state)

    def forward(self, letters: Tensor, valid_lens: Tensor) -> Tensor:
        """The phoneme ids (B, T) of greedy decoding (see the class)."""
        enc = self.encode(letters, valid_lens)
        B = letters.shape[0]
        tokens = torch.full_like(valid_lens, BOS_ID)
        state, feed = enc.state, enc.state.new_zeros(B, self.model.cfg.dec_hidden)
        emitted = []
        for _ in range(self.steps):
            logits, state, feed = self.model.step(tokens, state, feed, enc)
            tokens = logits.argmax(-1)
            emitted.append(tokens)
        return torch.stack(emitted, dim=1)


def export_greedy(model: G2PModel, letters: Vocab, phones: Vocab, max_letters: int) -> bytes:
    """The ONNX file (bytes) of :class:`GreedyDecoder` for ``model``.

    Inputs ``letters`` (B, L) int64 (letter ids padded with 0) and ``valid_lens`` (B,) int64
    (each in [1, L]); output ``phonemes`` (B, L + 10) int64; B dynamic. The metadata entry
    :data:`METADATA_KEY` holds JSON: ``letters`` and ``phones`` (the vocabularies, id ->
    token), ``max_letters``, ``steps``, ``pad_id``, ``bos_id``, ``eos_id``.

    Raises:
        ValueError: ``max_letters`` not a positive int.
        ModuleNotFoundError: onnx or onnxscript missing (the ``[onnx]`` extra).
    """
    decoder = GreedyDecoder(model, max_letters).eval()
    L = max_letters
    example_lens = torch.tensor([L, 1])
    example = torch.full((2, L), UNK_ID, dtype=torch.long)  # any ids: only shapes matter
    batch = torch.export.Dim("B")
    with torch.no_grad():
        program = onnx_export(
            decoder,
            (example, example_lens),
            input_names=["letters", "valid_lens"],
            output_names=["phonemes"],
            dynamic_shapes=({0: batch}, {0: batch}),
        )
    proto = program.model_proto
    entry = proto.metadata_props.add()
    entry.key = METADATA_KEY
    entry.value = json.dumps(
        {
            "letters": letters.itos,
            "phones": phones.itos,
            "max_letters": L,
            "steps": decoder.steps,
            "pad_id": PAD_ID,
            "bos_id": BOS_ID,
            "eos_id": EOS_ID,
        }
    )
    data: bytes = proto.SerializeToString()
    return data
