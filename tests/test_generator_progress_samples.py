"""A GAN generator's progress samples, drawn now and then in training mode, are no evaluation.

The DCGAN tutorial samples its generator on a fixed noise batch every N
iterations (and once an epoch) under ``no_grad``, never calling ``eval()``: its
batch norm uses the samples' own statistics, as in training, which is what
DCGAN does. Such samples, latent vectors in and many more values out with batch
norm alone in training mode, are one ``info`` line. A classifier validated
every N steps and an autoencoder's reconstructions of a validation batch, both
without ``model.eval()``, are still warnings.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import rules_of
from trainwatch.runner import run_script

SCRIPT = """
import sys
import torch
from torch import nn

case, watch = sys.argv[1], sys.argv[2]  # watch: none, first, both
torch.manual_seed(0)
nz = 16
G = nn.Sequential(
    nn.ConvTranspose2d(nz, 32, 4, 1, 0, bias=False), nn.BatchNorm2d(32), nn.ReLU(True),
    nn.ConvTranspose2d(32, 16, 4, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(True),
    nn.ConvTranspose2d(16, 1, 4, 2, 1, bias=False), nn.Tanh(),
)
D = nn.Sequential(
    nn.Conv2d(1, 16, 4, 2, 1, bias=False), nn.LeakyReLU(0.2),
    nn.Conv2d(16, 32, 4, 2, 1, bias=False), nn.BatchNorm2d(32), nn.LeakyReLU(0.2),
    nn.Conv2d(32, 1, 4, 1, 0, bias=False), nn.Flatten(0), nn.Sigmoid(),
)
classifier = nn.Sequential(
    nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
    nn.Linear(8 * 16 * 16, 10),
)
autoencoder = nn.Sequential(
    nn.Flatten(), nn.Linear(256, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 256),
    nn.Unflatten(1, (1, 16, 16)),
)
images = torch.randn(256, 1, 16, 16).tanh()
labels = torch.randint(0, 10, (256,))
batches = [(images[i : i + 32], labels[i : i + 32]) for i in range(0, 256, 32)]
fixed_noise = torch.randn(32, nz, 1, 1)
gan = case.startswith("gan")
first, second = (G, D) if gan else (classifier if case == "classifier" else autoencoder, None)
opt_1 = torch.optim.Adam(first.parameters(), 2e-4, betas=(0.5, 0.999))
opt_2 = torch.optim.Adam(D.parameters(), 2e-4, betas=(0.5, 0.999))
monitors = []
if watch != "none":
    import trainwatch as tw

    monitors.append(tw.watch(first, opt_1, console=False))
    if watch == "both" and second is not None:
        monitors.append(tw.watch(second, opt_2, console=False))
bce = nn.BCELoss()
iters = 0
for epoch in range(3):
    for i, (real, y) in enumerate(batches):
        if gan:
            D.zero_grad()
            loss_real = bce(D(real), torch.ones(32))
            fake = G(torch.randn(32, nz, 1, 1))
            (loss_real + bce(D(fake.detach()), torch.zeros(32))).backward()
            opt_2.step()
            G.zero_grad()
            bce(D(fake), torch.ones(32)).backward()
            opt_1.step()
        else:
            out = first(real)
            loss = nn.functional.cross_entropy(out, y) if case == "classifier" else (
                (out - real).pow(2).mean())
            opt_1.zero_grad()
            loss.backward()
            opt_1.step()
        if case in ("gan_every_n", "classifier", "autoencoder") and iters % 5 == 0:
            with torch.no_grad():  # no model.eval()
                if gan:
                    samples = G(fixed_noise).detach().cpu()
                else:
                    outputs = first(batches[0][0])
        iters += 1
    if case == "gan_every_epoch":
        with torch.no_grad():
            samples = G(fixed_noise)
for monitor in monitors:
    monitor.close()
"""

CASES = ["gan_every_n", "gan_every_epoch", "classifier", "autoencoder"]
GAN_CASES = CASES[:2]


def _watched(case: str, watch: str):
    """The script's loop in this process, the first model watched (or both)."""
    argv = sys.argv
    sys.argv = ["loop.py", case, watch]
    try:
        namespace: dict = {"__name__": "__main__"}
        exec(compile(SCRIPT, "loop.py", "exec"), namespace)
    finally:
        sys.argv = argv
    return namespace["monitors"][0]


def _under_run(tmp_path, case: str) -> list[dict]:
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    run_script(script, [case, "none"], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["rule"] == "eval_in_train_mode"]


@pytest.mark.parametrize("watch", ["first", "both"])
@pytest.mark.parametrize("case", GAN_CASES)
def test_dcgan_progress_samples_in_training_mode_are_info_under_watch(case, watch):
    monitor = _watched(case, watch)
    assert "eval_in_train_mode" not in rules_of(monitor)
    (alert,) = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert alert.severity == "info"
    assert alert.data["finding"] == "generator sampled in training mode"


@pytest.mark.parametrize("case", GAN_CASES)
def test_dcgan_progress_samples_in_training_mode_are_info_under_run(tmp_path, case):
    found = _under_run(tmp_path, case)
    assert found and {a["severity"] for a in found} == {"info"}


@pytest.mark.parametrize("case", ["classifier", "autoencoder"])
def test_a_validation_every_n_steps_without_eval_is_still_a_warning_under_watch(case):
    monitor = _watched(case, "first")
    assert "eval_in_train_mode" in rules_of(monitor)


@pytest.mark.parametrize("case", ["classifier", "autoencoder"])
def test_a_validation_every_n_steps_without_eval_is_still_a_warning_under_run(tmp_path, case):
    found = _under_run(tmp_path, case)
    assert found and {a["severity"] for a in found} == {"warning"}


@pytest.mark.parametrize(
    ("shape_in", "shape_out", "kinds", "sample"),
    [
        ((64, 100, 1, 1), (64, 3, 64, 64), ["BatchNorm2d"], True),  # DCGAN
        ((64, 100), (64, 16384), ["BatchNorm1d"], True),  # a 1-d generator (audio)
        ((64, 100, 1, 1), (64, 3, 64, 64), ["BatchNorm2d", "Dropout"], False),
        ((8, 3, 64, 64), (8, 19, 64, 64), ["BatchNorm2d"], False),  # segmentation
        ((8, 3, 32, 32), (8, 3, 128, 128), ["BatchNorm2d"], False),  # super-resolution
        ((64, 784), (64, 10), ["BatchNorm1d"], False),  # a classifier on vectors
        (None, (8, 128, 50000), ["BatchNorm1d"], False),  # token ids in
    ],
)
def test_a_generator_sample_is_latent_vectors_in_many_more_values_out_batch_norm_alone(
    shape_in, shape_out, kinds, sample
):
    from trainwatch.collect.eval_passes import generator_sample
    from trainwatch.record import ModeReport

    report = ModeReport([f"m{i}" for i in range(len(kinds))], kinds, True, len(kinds))
    report.input_shape, report.output_shape = shape_in, shape_out
    assert generator_sample(report) is sample
