"""zero_gradient: a recurrent model returning its state does not delay a cut before it.

A language model trained with truncated backpropagation returns ``(logits,
hidden)``; the loop detaches the state and feeds it back, and the loss reads
the logits only. The returned state is an output left out of the loss at
every step, which grants extra patience to layers feeding only such an output
(a head whose loss is off for now). A layer cut off inside the model (its
parameters in no output's graph) is not explained by it: the usual patience.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, EMB, HID, BPTT, BATCH = 50, 16, 24, 12, 8


class _LanguageModel(nn.Module):
    """The word-level LSTM language model of PyTorch's examples, small; ``aux``
    adds a second head (the token after next), returned before the state."""

    def __init__(self, cut_embedding: bool = False, aux: bool = False) -> None:
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, EMB)
        self.rnn = nn.LSTM(EMB, HID, 2, dropout=0.1)
        self.decoder = nn.Linear(HID, VOCAB)
        self.aux = nn.Linear(HID, VOCAB) if aux else None
        self.cut_embedding = cut_embedding

    def forward(self, tokens: torch.Tensor, hidden):
        emb = self.encoder(tokens)
        if self.cut_embedding:
            emb = emb.detach()  # "saves memory": the embedding leaves the graph
        output, hidden = self.rnn(emb, hidden)
        logits = self.decoder(output).view(-1, VOCAB)
        if self.aux is None:
            return logits, hidden
        return logits, self.aux(output).view(-1, VOCAB), hidden

    def init_hidden(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(2, BATCH, HID), torch.zeros(2, BATCH, HID)


def _corpus(steps: int) -> torch.Tensor:
    """A noisy cyclic grammar, batched as (time, batch)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(VOCAB, (steps * BPTT + 1, BATCH), generator=g)
    for t in range(1, len(tokens)):
        keep = torch.rand(BATCH, generator=g) < 0.8
        tokens[t] = torch.where(keep, (tokens[t - 1] * 7 + 3) % VOCAB, tokens[t])
    return tokens


def _train_language_model(quiet_watch, model: _LanguageModel, steps: int, aux_from: int = 0):
    """Truncated BPTT: the state detached between chunks; the aux head's loss (if
    any) is added from step ``aux_from`` on."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    monitor = quiet_watch(model, opt)
    data = _corpus(steps)
    hidden = model.init_hidden()
    for step in range(steps):
        x = data[step * BPTT : (step + 1) * BPTT]
        y = data[step * BPTT + 1 : (step + 1) * BPTT + 1].reshape(-1)
        hidden = tuple(h.detach() for h in hidden)
        model.zero_grad()
        logits, *aux, hidden = model(x, hidden)
        loss = F.cross_entropy(logits, y)
        if aux and step >= aux_from:
            loss = loss + F.cross_entropy(aux[0][:-BATCH], y[BATCH:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
    return monitor


def _zero_gradient(monitor) -> list[tuple[str, int, int]]:
    """Each finding's layer, the step its streak began, and the steps it took."""
    return [
        (a.module, a.step, a.data["steps"]) for a in monitor.alerts if a.rule == "zero_gradient"
    ]


def test_an_lstm_language_models_detached_embedding_is_found_within_the_usual_patience(
    quiet_watch,
):
    monitor = _train_language_model(quiet_watch, _LanguageModel(cut_embedding=True), 8)
    assert _zero_gradient(monitor) == [("encoder", 0, 3)]


def test_control_the_healthy_lstm_language_model_returning_its_state_is_silent(quiet_watch):
    monitor = _train_language_model(quiet_watch, _LanguageModel(), 30)
    assert [(a.rule, a.module) for a in monitor.alerts] == []


def test_a_head_whose_loss_starts_later_still_waits_beside_a_detached_embedding(quiet_watch):
    model = _LanguageModel(cut_embedding=True, aux=True)
    monitor = _train_language_model(quiet_watch, model, 12, aux_from=5)
    assert _zero_gradient(monitor) == [("encoder", 0, 3)]  # not the aux head


def test_control_a_head_whose_loss_starts_later_beside_the_state_is_silent(quiet_watch):
    model = _LanguageModel(aux=True)
    monitor = _train_language_model(quiet_watch, model, 20, aux_from=5)
    assert _zero_gradient(monitor) == []


class _Seq2Seq(nn.Module):
    """A GRU encoder-decoder returning the decoder's logits and its final state."""

    def __init__(self, cut_handover: bool = False) -> None:
        super().__init__()
        self.src_embed = nn.Embedding(VOCAB, EMB)
        self.encoder = nn.GRU(EMB, HID, batch_first=True)
        self.tgt_embed = nn.Embedding(VOCAB, EMB)
        self.decoder = nn.GRU(EMB, HID, batch_first=True)
        self.out = nn.Linear(HID, VOCAB)
        self.cut_handover = cut_handover

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor):
        _, state = self.encoder(self.src_embed(src))
        if self.cut_handover:
            state = state.detach()  # the encoder's state handed over detached
        output, state = self.decoder(self.tgt_embed(tgt_in), state)
        return self.out(output), state


class _Tagger(nn.Module):
    """A projection into ``nn.LSTM``, whose ``(output, (h, c))`` is the model's."""

    def __init__(self, projection_without_grad: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(6, EMB)
        self.lstm = nn.LSTM(EMB, 4, batch_first=True)
        self.projection_without_grad = projection_without_grad

    def forward(self, x: torch.Tensor):
        if self.projection_without_grad:
            with torch.no_grad():  # meant for evaluation only, left in
                features = torch.tanh(self.proj(x))
        else:
            features = torch.tanh(self.proj(x))
        return self.lstm(features)


def _train_seq2seq(quiet_watch, model: _Seq2Seq, steps: int):
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for _ in range(steps):
        src = torch.randint(VOCAB, (BATCH, 9))
        tgt = src.flip(1)  # reverse the sequence
        logits, _ = model(src, tgt[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tgt[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return monitor


def _train_tagger(quiet_watch, model: _Tagger, steps: int):
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for _ in range(steps):
        x = torch.randn(BATCH, 7, 6)
        output, _ = model(x)
        loss = F.mse_loss(output, torch.tanh(x[..., :4].cumsum(1)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return monitor


def test_a_gru_seq2seqs_encoder_state_handed_over_detached_is_found_within_the_usual_patience(
    quiet_watch,
):
    monitor = _train_seq2seq(quiet_watch, _Seq2Seq(cut_handover=True), 8)
    assert sorted(_zero_gradient(monitor)) == [("encoder", 0, 3), ("src_embed", 0, 3)]


def test_control_the_healthy_gru_seq2seq_returning_its_state_is_silent(quiet_watch):
    monitor = _train_seq2seq(quiet_watch, _Seq2Seq(), 20)
    assert _zero_gradient(monitor) == []


def test_a_projection_under_no_grad_before_a_returned_lstm_is_found_within_the_usual_patience(
    quiet_watch,
):
    monitor = _train_tagger(quiet_watch, _Tagger(projection_without_grad=True), 8)
    assert _zero_gradient(monitor) == [("proj", 0, 3)]


def test_control_the_healthy_model_returning_an_lstms_output_and_state_is_silent(quiet_watch):
    monitor = _train_tagger(quiet_watch, _Tagger(), 20)
    assert _zero_gradient(monitor) == []


class _CheckpointedDetector(nn.Module):
    """Class logits and boxes, the box head behind a reentrant checkpoint: its
    parameters are in no graph of the pass (the checkpoint re-runs it in backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 32)
        self.cls = nn.Linear(32, 3)
        self.box = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor):
        h = torch.relu(self.body(x))
        return self.cls(h), checkpoint(self.box, h, use_reentrant=True)


def _train_detector(quiet_watch, model: _CheckpointedDetector, box_from: int, steps: int):
    """The box loss is added from step ``box_from`` on (the first batches hold no
    positive box)."""
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for step in range(steps):
        x = torch.randn(16, 8)
        logits, boxes = model(x)
        loss = F.cross_entropy(logits, torch.randint(0, 3, (16,)))
        if step >= box_from:
            loss = loss + F.smooth_l1_loss(boxes, x[:, :4])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return monitor


def test_control_a_checkpointed_head_whose_loss_starts_later_is_silent(quiet_watch):
    monitor = _train_detector(quiet_watch, _CheckpointedDetector(), 5, 20)
    assert _zero_gradient(monitor) == []
