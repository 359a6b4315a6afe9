"""The note under autograd's "backward through the graph a second time" error.

Torch's message suggests ``retain_graph=True``, which is almost never the fix
in a training loop: the error means a tensor carried over from an earlier step
still holds that step's graph, freed by its backward. The usual carriers are a
recurrent hidden state passed from one batch to the next (truncated BPTT
without ``detach()``), a running total of losses (``total += loss``) that is
backpropagated, and a tensor computed once before the loop from the model's
parameters. ``retain_graph=True`` turns the error into a slower and wrong
training: every backward runs again through every earlier step's graph, with
weights the optimizer has since moved (or fails on them a step later).

The error is raised inside backward, where no module frame names a layer, so
the note is read from the exception's message and the model's kind, after the
exception: a healthy step pays nothing for it.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from trainwatch.collect.model_kind import recurrent_modules

NOTE_PREFIX = "trainwatch: backward reached a graph an earlier backward freed"
_FREED_GRAPH = "backward through the graph a second time"


def graph_reuse_note(exc: BaseException, roots: Iterable[nn.Module]) -> str | None:
    """The note for a freed-graph error (None for any other error): what carries a
    graph across steps, the hidden state first where the model is recurrent."""
    if _FREED_GRAPH not in str(exc):
        return None
    recurrent = [name or type(root).__name__ for root in roots for name in recurrent_modules(root)]
    carriers = [
        "a running total of losses that is backpropagated (add loss.item(), "
        "or backpropagate each loss)",
        "a tensor computed once before the loop from the model's parameters "
        "(compute it inside the loop, or under torch.no_grad() if it is a constant)",
    ]
    hidden = (
        "a hidden state passed from one batch to the next (truncated BPTT: "
        "h = h.detach(), or tuple(x.detach() for x in h) for an LSTM, before each batch)"
    )
    if recurrent:
        shown = ", ".join(recurrent[:3]) + (", …" if len(recurrent) > 3 else "")
        carriers.insert(0, f"{hidden}; the model holds recurrent layers: {shown}")
    else:
        carriers.append(hidden)
    listed = "; ".join(f"({index}) {text}" for index, text in enumerate(carriers, 1))
    return (
        f"{NOTE_PREFIX}: a tensor carried over from an earlier step still holds "
        f"that step's graph. Usually {listed}. retain_graph=True hides the error "
        "but makes every backward run again through every earlier step's graph, "
        "with weights the optimizer has since changed."
    )
