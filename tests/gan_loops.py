"""GAN training loops written the way they usually are, for the tests of GANs
watched without their optimizers.

A WGAN with weight clipping (RMSprop, five critic steps per generator step),
a WGAN-GP (Adam, five critic steps, the gradient penalty through
``torch.autograd.grad``) and a DCGAN (Adam, one discriminator step per
generator step), over 2-D points on a ring of eight Gaussians or 8x8 images
of a bright square, made on the spot. Switches plant the bugs: the
discriminator frozen for the generator's step (``requires_grad_(False)``,
then back), ``opt_d.step()`` forgotten, ``opt_g.zero_grad()`` forgotten.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

Z = 8
BATCH = 32
KINDS = ("wgan_clip", "wgan_gp", "dcgan")


def ring(n: int, generator: torch.Generator) -> torch.Tensor:
    """Points around a ring of eight Gaussians."""
    centre = torch.randint(0, 8, (n,), generator=generator).float() * (2 * math.pi / 8)
    points = torch.stack([centre.cos(), centre.sin()], dim=1) * 2.0
    return points + 0.05 * torch.randn(n, 2, generator=generator)


def squares(n: int, generator: torch.Generator) -> torch.Tensor:
    """8x8 one-channel images, -1 but for a bright 3x3 square somewhere."""
    images = -torch.ones(n, 1, 8, 8)
    corners = torch.randint(0, 6, (n, 2), generator=generator)
    for image, (row, col) in zip(images, corners.tolist()):
        image[0, row : row + 3, col : col + 3] = 1.0
    return images


class GAN(nn.Module):
    """Both halves in one module, as a LightningModule holds them."""

    def __init__(self, images: bool = False) -> None:
        super().__init__()
        if images:
            self.G = nn.Sequential(
                nn.Linear(Z, 64 * 2 * 2),
                nn.Unflatten(1, (64, 2, 2)),
                nn.ConvTranspose2d(64, 32, 4, 2, 1),
                nn.ReLU(),
                nn.ConvTranspose2d(32, 1, 4, 2, 1),
                nn.Tanh(),
            )
            self.D = nn.Sequential(
                nn.Conv2d(1, 32, 4, 2, 1),
                nn.LeakyReLU(0.2),
                nn.Conv2d(32, 64, 4, 2, 1),
                nn.LeakyReLU(0.2),
                nn.Flatten(),
                nn.Linear(64 * 2 * 2, 1),
            )
        else:
            self.G = nn.Sequential(nn.Linear(Z, 64), nn.ReLU(), nn.Linear(64, 2))
            self.D = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))


@dataclass(frozen=True)
class Loop:
    """One training loop. ``mark``: called with the generator's loss once an iteration
    (the loop calling ``monitor.step()`` itself)."""

    kind: str = "wgan_gp"
    images: bool = False
    iterations: int = 12
    freeze_d: bool = False  # D frozen for G's step
    d_step: bool = True  # False: opt_d.step() forgotten
    g_reset: bool = True  # False: opt_g.zero_grad() forgotten

    @property
    def critic_steps(self) -> int:
        return 1 if self.kind == "dcgan" else 5

    def build(self) -> tuple[GAN, torch.optim.Optimizer, torch.optim.Optimizer]:
        torch.manual_seed(0)
        gan = GAN(self.images)
        if self.kind == "wgan_clip":
            return (
                gan,
                torch.optim.RMSprop(gan.G.parameters(), lr=5e-5),
                torch.optim.RMSprop(gan.D.parameters(), lr=5e-5),
            )
        betas = (0.5, 0.999) if self.kind == "dcgan" else (0.5, 0.9)
        return (
            gan,
            torch.optim.Adam(gan.G.parameters(), lr=2e-4, betas=betas),
            torch.optim.Adam(gan.D.parameters(), lr=2e-4, betas=betas),
        )

    def train(
        self,
        gan: GAN,
        opt_g: torch.optim.Optimizer,
        opt_d: torch.optim.Optimizer,
        mark: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        G, D = gan.G, gan.D
        data = torch.Generator().manual_seed(1)
        real_data = squares if self.images else ring
        bce = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(BATCH, 1), torch.zeros(BATCH, 1)
        for _ in range(self.iterations):
            for _ in range(self.critic_steps):
                real = real_data(BATCH, data)
                fake = G(torch.randn(BATCH, Z, generator=data)).detach()
                opt_d.zero_grad()
                if self.kind == "dcgan":
                    loss_d = bce(D(real), ones) + bce(D(fake), zeros)
                else:
                    loss_d = D(fake).mean() - D(real).mean()
                if self.kind == "wgan_gp":
                    alpha = torch.rand(BATCH, *[1] * (real.dim() - 1), generator=data)
                    mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
                    (grad,) = torch.autograd.grad(D(mixed).sum(), mixed, create_graph=True)
                    loss_d = loss_d + 10 * ((grad.flatten(1).norm(dim=1) - 1) ** 2).mean()
                loss_d.backward()
                if self.d_step:
                    opt_d.step()
                if self.kind == "wgan_clip":
                    for p in D.parameters():
                        p.data.clamp_(-0.01, 0.01)
            if self.freeze_d:
                for p in D.parameters():
                    p.requires_grad_(False)
            if self.g_reset:
                opt_g.zero_grad()
            score = D(G(torch.randn(BATCH, Z, generator=data)))
            loss_g = bce(score, ones) if self.kind == "dcgan" else -score.mean()
            loss_g.backward()
            opt_g.step()
            if self.freeze_d:
                for p in D.parameters():
                    p.requires_grad_(True)
            if mark is not None:
                mark(loss_g)
