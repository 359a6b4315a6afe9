"""Optimizer wrappers as their reference implementations write them (SAM, Lookahead,
PCGrad and others), as source: tests run them in a loop and in scripts alike."""

from __future__ import annotations

WRAPPERS = '''
from collections import defaultdict

import torch


class SAM(torch.optim.Optimizer):
    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.norm(torch.stack([p.grad.norm() for p in params]))
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                e_w = p.grad * g["rho"] / (norm + 1e-12)
                p.add_(e_w)
                self.state[p]["e_w"] = e_w
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for g in self.param_groups:
            for p in g["params"]:
                if "e_w" in self.state[p]:
                    p.sub_(self.state[p]["e_w"])
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        closure = torch.enable_grad()(closure)
        self.first_step(zero_grad=True)
        closure()
        self.second_step()


class Lookahead(torch.optim.Optimizer):
    def __init__(self, optimizer, k=5, alpha=0.5):
        self._base_optimizer, self.k, self.alpha = optimizer, k, alpha
        self.param_groups = self._base_optimizer.param_groups
        self.state = defaultdict(dict)
        for group in self.param_groups:
            group["counter"] = 0

    def update(self, group):
        for fast in group["params"]:
            state = self.state[fast]
            if "slow_param" not in state:
                state["slow_param"] = fast.detach().clone()
            slow = state["slow_param"]
            slow += (fast.data - slow) * self.alpha
            fast.data.copy_(slow)

    def step(self, closure=None):
        loss = self._base_optimizer.step(closure)
        for group in self.param_groups:
            if group["counter"] == 0:
                self.update(group)
            group["counter"] = (group["counter"] + 1) % self.k
        return loss

    def zero_grad(self, set_to_none=True):
        self._base_optimizer.zero_grad(set_to_none)


class PlainLookahead:
    """Lookahead written as a plain class: it holds ``optimizer`` and shares its groups."""

    def __init__(self, optimizer, k=5, alpha=0.5):
        self.optimizer, self.k, self.alpha = optimizer, k, alpha
        self.param_groups = optimizer.param_groups
        self.state = defaultdict(dict)
        self._counter = 0
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["slow"] = p.detach().clone()

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.optimizer.step(closure)
        self._counter += 1
        if self._counter % self.k == 0:
            for group in self.param_groups:
                for p in group["params"]:
                    slow = self.state[p]["slow"]
                    slow.add_(p - slow, alpha=self.alpha)
                    p.copy_(slow)
        return loss


class PlainLookaheadOptimizer(PlainLookahead, torch.optim.Optimizer):
    """The same, an ``Optimizer`` subclass that never runs ``Optimizer.__init__``."""


class Holder:
    """Holds an optimizer but trains parameters of its own: no wrapper of it."""

    def __init__(self, optimizer, params):
        self.optimizer = optimizer
        self.param_groups = [{"params": list(params)}]


class PCGrad:
    """A gradient-surgery wrapper (PCGrad's layout): holds its optimizer as ``_optim``
    and trains its parameters, with no ``param_groups`` of its own."""

    def __init__(self, optimizer):
        self._optim = optimizer

    def zero_grad(self):
        return self._optim.zero_grad(set_to_none=True)

    def step(self):
        return self._optim.step()


class Unhooked(torch.optim.Optimizer):
    """An optimizer of its own that skips ``Optimizer.__init__`` and wraps nothing."""

    def __init__(self, params, lr=0.1):
        self.param_groups = [{"params": list(params), "lr": lr}]
        self.state = {}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])

    def zero_grad(self, set_to_none=True):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
'''

_NAMESPACE: dict = {}
exec(compile(WRAPPERS, "wrappers", "exec"), _NAMESPACE)
SAM, Lookahead, Unhooked = (_NAMESPACE[name] for name in ("SAM", "Lookahead", "Unhooked"))
PlainLookahead, PlainLookaheadOptimizer, Holder, PCGrad = (
    _NAMESPACE[name] for name in ("PlainLookahead", "PlainLookaheadOptimizer", "Holder", "PCGrad")
)
