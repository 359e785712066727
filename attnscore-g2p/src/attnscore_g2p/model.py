"""Attention encoder-decoder for G2P: BiGRU over letters, GRU over phonemes, any scorer.

The decoder is Luong-style: at step t the GRU state ``h_t`` is the query of the attention
module over the (projected) encoder states, masked with the word lengths as ``valid_lens``;
``tanh(W_c [h_t; c_t])`` predicts the next phoneme.  Without input feeding (the default) the
teacher-forced decoder runs over all steps at once, with one attention call for all queries;
with ``input_feeding=True`` that attentional vector is also fed to the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from attnscore.modules import make_scorer

from .config import ModelConfig
from .data import BOS_ID, EOS_ID, PAD_ID


@dataclass
class Encoded:
    """Encoder output for a batch.

    Attributes:
        keys: (B, S, H) float, projected encoder states (keys and values of the attention).
        valid_lens: (B,) int64, number of letters per word.
        state: (1, B, H) float, initial decoder state.
    """

    keys: Tensor
    valid_lens: Tensor
    state: Tensor


class G2PModel(nn.Module):
    """Letters -> phonemes sequence-to-sequence model with a pluggable attention scorer.

    Args:
        cfg: the hyper-parameters; ``cfg.scoring`` names a scorer of
            :mod:`attnscore.registry`, built for queries and keys of size ``dec_hidden``.
        n_letters: size of the letter vocabulary (specials included).
        n_phones: size of the phoneme vocabulary (specials included).
    """

    def __init__(self, cfg: ModelConfig, n_letters: int, n_phones: int):
        super().__init__()
        self.cfg = cfg
        H = cfg.dec_hidden
        self.src_emb = nn.Embedding(n_letters, cfg.emb, padding_idx=PAD_ID)
        self.encoder = nn.GRU(
            cfg.emb,
            cfg.enc_hidden,
            num_layers=cfg.enc_layers,
            bidirectional=True,
            batch_first=True,
            dropout=cfg.dropout if cfg.enc_layers > 1 else 0.0,
        )
        self.key_proj = nn.Linear(2 * cfg.enc_hidden, H)
        self.init_proj = nn.Linear(2 * cfg.enc_hidden, H)
        self.tgt_emb = nn.Embedding(n_phones, cfg.emb, padding_idx=PAD_ID)
        self.decoder = nn.GRU(cfg.emb + (H if cfg.input_feeding else 0), H, batch_first=True)
        self.attention = make_scorer(cfg.scoring, H, H, num_hiddens=H, dropout=cfg.dropout)
        self.combine = nn.Linear(2 * H, H)
        self.out = nn.Linear(H, n_phones)
        self.drop = nn.Dropout(cfg.dropout)

    def encode(self, src: Tensor, valid_lens: Tensor) -> Encoded:
        """Encode letters ``src`` (B, S) int64, padded with 0, of lengths ``valid_lens`` (B,)
        int64, all >= 1."""
        if src.dim() != 2 or valid_lens.shape != src.shape[:1]:
            raise ValueError(
                f"Expected src (B, S) and valid_lens (B,), but got {tuple(src.shape)} and "
                f"{tuple(valid_lens.shape)} instead"
            )
        x = self.drop(self.src_emb(src))
        packed = pack_padded_sequence(x, valid_lens.cpu(), batch_first=True, enforce_sorted=False)
        out, h = self.encoder(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=src.shape[1])
        final = torch.cat([h[-2], h[-1]], dim=-1)  # last layer, forward and backward
        state = torch.tanh(self.init_proj(final)).unsqueeze(0)
        return Encoded(self.key_proj(self.drop(out)), valid_lens.to(out.device), state)

    def _attend(self, dec_out: Tensor, enc: Encoded) -> Tensor:
        """(B, n, H) decoder states -> (B, n, H) attentional vectors ``tanh(W_c [h; c])``."""
        ctx = self.attention(dec_out, enc.keys, enc.keys, enc.valid_lens)
        return torch.tanh(self.combine(torch.cat([dec_out, ctx], dim=-1)))

    def forward(self, src: Tensor, valid_lens: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher-forced logits (B, T, n_phones) float for ``p1 .. </s>``, of letters ``src``
        (B, S) int64, ``valid_lens`` (B,) int64 and ``tgt_in`` (B, T) int64 ``<s> p1 ..``."""
        enc = self.encode(src, valid_lens)
        y = self.drop(self.tgt_emb(tgt_in))
        if not self.cfg.input_feeding:
            dec_out, _ = self.decoder(y, enc.state)
            logits: Tensor = self.out(self.drop(self._attend(dec_out, enc)))
            return logits
        state, feed = enc.state, y.new_zeros(y.shape[0], self.cfg.dec_hidden)
        outs = []
        for t in range(y.shape[1]):
            logits, state, feed = self._step(y[:, t], state, feed, enc)
            outs.append(logits)
        return torch.stack(outs, dim=1)

    def _step(
        self, y: Tensor, state: Tensor, feed: Tensor, enc: Encoded
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One decoder step: y (B, E) embedded token, state (1, B, H), feed (B, H)."""
        inp = torch.cat([y, feed], dim=-1) if self.cfg.input_feeding else y
        dec_out, state = self.decoder(inp.unsqueeze(1), state)
        tilde = self._attend(dec_out, enc)[:, 0]
        return self.out(self.drop(tilde)), state, tilde

    def step(
        self, tokens: Tensor, state: Tensor, feed: Tensor, enc: Encoded
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Decode one step from previous tokens (B,) int64 -> (logits (B, V), state, feed)."""
        return self._step(self.tgt_emb(tokens), state, feed, enc)

    @torch.no_grad()
    def greedy(
        self, src: Tensor, valid_lens: Tensor, max_len: int | None = None
    ) -> tuple[list[list[int]], list[Tensor]]:
        """Greedy decoding.

        Returns:
            Per word the phoneme ids (without ``</s>``) and its attention weights as a
            (len(ids) + 1, S_word) float tensor (one row per emitted token incl. ``</s>``;
            len(ids) rows when decoding stopped at ``max_len`` without ``</s>``).
        """
        enc = self.encode(src, valid_lens)
        B = src.shape[0]
        max_len = max_len or int(valid_lens.max()) + 10
        tokens = torch.full((B,), BOS_ID, dtype=torch.long, device=src.device)
        state, feed = enc.state, enc.state.new_zeros(B, self.cfg.dec_hidden)
        done = torch.zeros(B, dtype=torch.bool, device=src.device)
        out_ids, weights = [], []
        for _ in range(max_len):
            logits, state, feed = self.step(tokens, state, feed, enc)
            tokens = logits.argmax(-1)
            out_ids.append(tokens)
            weights.append(self.last_attention_weights())
            done |= tokens == EOS_ID
            if bool(done.all()):
                break
        ids = torch.stack(out_ids, dim=1).tolist()
        w = torch.cat(weights, dim=1)  # (B, steps, S)
        seqs, alignments = [], []
        for b in range(B):
            n = ids[b].index(EOS_ID) if EOS_ID in ids[b] else len(ids[b])
            seqs.append(ids[b][:n])
            alignments.append(w[b, : n + 1, : int(valid_lens[b])].cpu())
        return seqs, alignments

    @torch.no_grad()
    def teacher_forced_attention(
        self, src: Tensor, valid_lens: Tensor, tgt_in: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The attention's inputs and weights over a teacher-forced pass of :meth:`forward`'s
        inputs, in evaluation mode (the module's mode is restored after): ``(queries (B, T,
        H), keys (B, S, H), weights (B, T, S))``, the decoder states, the projected letters
        and the attention weights of every step (one attention call for all steps, or one
        per step with input feeding, concatenated)."""
        calls: list[tuple[Tensor, Tensor, Tensor]] = []

        def keep(_module: nn.Module, args: tuple[Any, ...], _output: Any) -> None:
            calls.append((args[0], args[1], self.last_attention_weights()))

        handle = self.attention.register_forward_hook(keep)
        training = self.training
        self.eval()
        try:
            self(src, valid_lens, tgt_in)
        finally:
            handle.remove()
            self.train(training)
        queries = torch.cat([q for q, _, _ in calls], dim=1)
        weights = torch.cat([w for _, _, w in calls], dim=1)
        return queries, calls[0][1], weights

    def last_attention_weights(self) -> Tensor:
        """Attention weights (B, n, S) float of the last decoder call (detached)."""
        w = getattr(self.attention, "attention_weights", None)
        if w is None:  # pragma: no cover - every scorer of the library records them
            raise RuntimeError("Expected the attention module to record attention_weights")
        weights: Tensor = w.detach()
        return weights

    @torch.no_grad()
    def beam_search(
        self,
        src: Tensor,
        valid_lens: Tensor,
        beam: int = 5,
        max_len: int | None = None,
        length_norm: float = 0.0,
    ) -> tuple[list[list[int]], list[Tensor]]:
        """Batched beam search over sums of log-probabilities.

        A hypothesis that has emitted ``</s>`` stays in its beam with a frozen score, so it
        competes with the live ones; a word is done when all its beams are finished. The
        final choice among the K hypotheses ranks ``score / length ** length_norm``
        (length counts ``</s>``; Wu et al. 2016 use a similar penalty): 0 is the plain sum.

        Args:
            src: (B, S) int64 letter ids padded with 0; valid_lens: (B,) int64.
            beam: beam width K >= 1.
            max_len: most decoder steps (default: longest word + 10).
            length_norm: exponent alpha >= 0 of the length normalisation.

        Returns:
            Per word the best phoneme ids (without ``</s>``) and its attention weights as a
            (len(ids) + 1, S_word) float tensor, as :meth:`greedy`.
        """
        if beam < 1:
            raise ValueError(f"Expected beam >= 1, but got {beam} instead")
        B, K = src.shape[0], beam
        enc = self.encode(src, valid_lens)
        flat = Encoded(
            enc.keys.repeat_interleave(K, 0), enc.valid_lens.repeat_interleave(K, 0), enc.state
        )
        state = enc.state.repeat_interleave(K, 1)
        feed = state.new_zeros(B * K, self.cfg.dec_hidden)
        scores = torch.full((B, K), float("-inf"), device=src.device)
        scores[:, 0] = 0.0
        tokens = torch.full((B * K,), BOS_ID, dtype=torch.long, device=src.device)
        finished = torch.zeros(B, K, dtype=torch.bool, device=src.device)
        lengths = torch.zeros(B, K, device=src.device)
        base = torch.arange(B, device=src.device)[:, None] * K
        toks_hist, parents_hist, att_hist = [], [], []
        for _ in range(max_len or int(valid_lens.max()) + 10):
            logits, state, feed = self.step(tokens, state, feed, flat)
            att_hist.append(self.last_attention_weights()[:, 0])  # (B*K, S), by parent row
            logp = torch.log_softmax(logits.float(), dim=-1)
            logp[:, PAD_ID] = float("-inf")
            logp[:, BOS_ID] = float("-inf")
            done_rows = finished.view(-1)
            logp[done_rows] = float("-inf")
            logp[done_rows, EOS_ID] = 0.0  # a finished hypothesis only "emits" </s> again
            V = logp.shape[1]
            cand = (scores.view(-1, 1) + logp).view(B, K * V)
            scores, top = cand.topk(K, dim=1)  # (B, K)
            parent, tok = top // V, top % V
            rows = (base + parent).view(-1)
            state, feed = state[:, rows], feed[rows]
            was_done = finished.gather(1, parent)
            lengths = lengths.gather(1, parent) + (~was_done).float()
            finished = was_done | (tok == EOS_ID)
            toks_hist.append(tok)
            parents_hist.append(parent)
            tokens = tok.view(-1)
            if bool(finished.all()):
                break
        ranked = scores / lengths.clamp(min=1.0) ** length_norm if length_norm else scores
        best = ranked.argmax(dim=1).tolist()
        seqs, alignments = [], []
        for b in range(B):
            k, ids, rows_att = best[b], [], []
            for t in range(len(toks_hist) - 1, -1, -1):
                ids.append(int(toks_hist[t][b, k]))
                k = int(parents_hist[t][b, k])
                rows_att.append(att_hist[t][b * K + k])
            ids.reverse()
            rows_att.reverse()
            n = ids.index(EOS_ID) if EOS_ID in ids else len(ids)
            seqs.append(ids[:n])
            alignments.append(torch.stack(rows_att[: n + 1])[:, : int(valid_lens[b])].cpu())
        return seqs, alignments


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
