"""Pre-train, then fine-tune: the usual two-phase script, as people write it.

Phase 1 fits a regression head until its gradients are small; phase 2
replaces the head (same attribute name, a new task with 5 classes), builds a
new optimizer and fine-tunes. Arguments choose the variant:

* ``replace`` (default): a new head and a new optimizer;
* ``same-optimizer``: a new head, still trained by phase 1's optimizer
  (rebuilt over the new parameters is the usual fix; this keeps the old one
  and adds the head to it as a new param group);
* ``spike``: phase 2 scales one batch's loss by 1e4 at its step 60 (a real
  exploding gradient, which must still be caught after the new warm-up).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

torch.manual_seed(0)
torch.set_num_threads(1)
variant = sys.argv[1] if len(sys.argv) > 1 else "replace"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


gen = torch.Generator().manual_seed(0)
x_all = torch.randn(512, 8, generator=gen)
model = Net()
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
for step in range(150):
    x = x_all[(step * 32) % 512 :][:32]
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), x[:, :1].sin() * 0.1).backward()
    optimizer.step()

model.head = nn.Linear(32, 5)  # the new task's head, under the old name
if variant == "same-optimizer":
    optimizer.add_param_group({"params": model.head.parameters()})
else:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
labels = (x_all[:, 0] > 0).long() + 2 * (x_all[:, 1] > 0).long()
for step in range(100):
    x, y = x_all[(step * 32) % 512 :][:32], labels[(step * 32) % 512 :][:32]
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x) * 10.0, y)
    if variant == "spike" and step == 60:
        loss = loss * 1e4
    loss.backward()
    optimizer.step()
print("done")
