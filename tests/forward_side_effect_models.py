"""Models whose forward changes their own state on every call, and the loop that trains them.

Shared by the in-process tests, the Lightning module and the unmodified
scripts run under ``trainwatch run`` (which import this module), so each
shape trains the very same model. Each forward returns what its encoders
compute alone, so a learning rate of 0 leaves it unmoved; the state it
changes feeds the loss, so a change left by a re-run shows in the losses.

- ``moco``: MoCo v2 as its authors wrote it: the key encoder moved by
  ``param_k.data = param_k.data * m + param_q.data * (1 - m)``, the keys
  written in place into a queue kept as a plain tensor attribute, at a
  pointer kept as an int.
- ``ema``: a mean teacher updated in place (``mul_``/``add_``) in forward.
- ``xbm``: a cross-batch memory, a deque of past embeddings appended to.
- ``hidden_ema``: the same with the teacher kept out of the module's tables
  (``object.__setattr__``, so its weights are no parameters of the model).
- ``counter``: a registered buffer counting the calls in place, a plain int
  and a module-level global (``global CALLS``) counting them too, and a
  module-level list appended to.
- ``bank``: an instance-discrimination memory bank kept in a plain object
  of its own (a tensor written in place at the batch's indices, a count).
- ``plain``: an MLP with no state of its own (the control).
"""

from __future__ import annotations

import copy
from collections import deque
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

CALLS = 0  # counted by Counter.forward through ``global``
LOG: list[int] = []  # appended to by Counter.forward
DIM, ROWS, SIZE = 8, 32, 256  # input width, batch, samples in the data set


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, 4))


class MoCo(nn.Module):
    def __init__(self, queue: int = 64, m: float = 0.9) -> None:
        super().__init__()
        self.m = m
        self.encoder_q = _mlp()
        self.encoder_k = copy.deepcopy(self.encoder_q)
        for param in self.encoder_k.parameters():
            param.requires_grad = False
        self.queue = F.normalize(torch.randn(queue, 4), dim=1)  # no buffer: a plain tensor
        self.ptr = 0

    def forward(self, xq: torch.Tensor, xk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = F.normalize(self.encoder_q(xq), dim=1)
        with torch.no_grad():
            for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
                param_k.data = param_k.data * self.m + param_q.data * (1.0 - self.m)
            k = F.normalize(self.encoder_k(xk), dim=1)
            n = k.shape[0]
            self.queue[self.ptr : self.ptr + n] = k
            self.ptr = (self.ptr + n) % self.queue.shape[0]
        return q, k

    def extra(self) -> dict[str, Any]:
        return {"queue": self.queue.clone(), "ptr": self.ptr}


class MeanTeacher(nn.Module):
    def __init__(self, m: float = 0.9) -> None:
        super().__init__()
        self.m = m
        self.student = _mlp()
        self.teacher = copy.deepcopy(self.student)
        self.teacher.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            for param_s, param_t in zip(self.student.parameters(), self.teacher.parameters()):
                param_t.mul_(self.m).add_(param_s.detach(), alpha=1.0 - self.m)
            target = self.teacher(x)
        return self.student(x), target

    def extra(self) -> dict[str, Any]:
        return {}


class HiddenTeacher(MeanTeacher):
    def __init__(self, m: float = 0.9) -> None:
        super().__init__(m)
        teacher = self.teacher
        del self.teacher
        object.__setattr__(self, "teacher", teacher)

    def extra(self) -> dict[str, Any]:
        return {key: value.clone() for key, value in self.teacher.state_dict().items()}


class CrossBatchMemory(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = _mlp()
        self.memory: deque[torch.Tensor] = deque(maxlen=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = F.normalize(self.fc(x), dim=1)
        self.memory.append(e.detach())
        return e

    def extra(self) -> dict[str, Any]:
        return {"memory": [t.clone() for t in self.memory]}


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = _mlp()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global CALLS
        CALLS += 1
        self.calls += 1
        self.seen += 1
        LOG.append(self.seen)
        return self.fc(x)

    def extra(self) -> dict[str, Any]:
        return {"seen": self.seen, "global": CALLS, "log": list(LOG)}


class FeatureBank:
    """Not a module: a memory bank of one feature per sample, and a count of writes."""

    def __init__(self) -> None:
        self.features = F.normalize(torch.randn(SIZE, 4), dim=1)
        self.writes = 0


class InstanceBank(nn.Module):
    def __init__(self, m: float = 0.5) -> None:
        super().__init__()
        self.fc = _mlp()
        self.m = m
        self.bank = FeatureBank()

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        e = F.normalize(self.fc(x), dim=1)
        with torch.no_grad():
            mixed = self.bank.features[idx] * self.m + e.detach() * (1.0 - self.m)
            self.bank.features[idx] = F.normalize(mixed, dim=1)
            self.bank.writes += 1
        return e

    def extra(self) -> dict[str, Any]:
        return {"features": self.bank.features.clone(), "writes": self.bank.writes}


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def extra(self) -> dict[str, Any]:
        return {}


MODELS = {
    "moco": MoCo,
    "ema": MeanTeacher,
    "hidden_ema": HiddenTeacher,
    "xbm": CrossBatchMemory,
    "counter": Counter,
    "bank": InstanceBank,
    "plain": Plain,
}


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each step's batch, its indices in the data set and a second noise draw."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(ROWS, DIM, generator=gen)
        idx = torch.randperm(SIZE, generator=gen)[:ROWS]
        out.append((x, idx, 0.1 * torch.randn(2, ROWS, DIM, generator=gen)))
    return out


def step_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The loss of one step: the model's output against the state its forward keeps."""
    x, idx, noise = batch
    target = x[:, :4].tanh()
    if isinstance(model, MoCo):
        q, k = model(x + noise[0], x + noise[1])
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ model.queue.clone().t()], dim=1)
        return F.cross_entropy(logits / 0.2, torch.zeros(len(x), dtype=torch.long))
    if isinstance(model, MeanTeacher):
        out, teacher = model(x)
        return F.mse_loss(out, target) + F.mse_loss(out, teacher)
    if isinstance(model, CrossBatchMemory):
        e = model(x)
        return (e @ torch.cat(list(model.memory)).t() / 0.1).logsumexp(1).mean()
    if isinstance(model, InstanceBank):
        e = model(x, idx)
        return (e @ model.bank.features.clone().t() / 0.1).logsumexp(1).mean()
    if isinstance(model, Counter):
        return F.mse_loss(model(x), target) * (1.0 + 0.01 * float(model.calls % 3))
    return F.mse_loss(model(x), target)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def train(name: str, steps: int = 12, lr: float = 0.05, watch: Any = None, **config: Any) -> Any:
    """Losses and the final state of ``steps`` SGD steps over model ``name``; under
    ``watch(model, opt, **config)`` when given (its monitor closed at the end)."""
    global CALLS
    CALLS = 0
    LOG.clear()
    torch.manual_seed(0)
    model = MODELS[name]()
    opt = torch.optim.SGD(trainable(model), lr=lr, momentum=0.9)
    monitor = watch(model, opt, **config) if watch is not None else None
    losses = []
    for batch in batches(steps):
        loss = step_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if monitor is not None:
        monitor.close()
    return losses, final_state(model), monitor


def final_state(model: nn.Module) -> dict[str, Any]:
    state = {key: value.clone() for key, value in model.state_dict().items()}
    return {"state": state, "extra": model.extra()}


def same(a: Any, b: Any) -> bool:
    """Bit for bit (a NaN as the same NaN): tensors byte by byte, containers item by item."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or (a.dtype, a.shape) != (b.dtype, b.shape):
            return False
        return torch.equal(_bytes(a), _bytes(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    return a == b


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)
