"""A warning the script already showed once is not shown again because trainwatch
attached, trained or closed.

Python shows a ``default`` (or ``once``) warning once per code location, from a
registry in the globals of the module that warns; any change made through the
warnings API (``filterwarnings``, ``catch_warnings``, ``_filters_mutated``)
empties every registry at its next warning, and the warning shows again. A
warning shown before trainwatch attached is the case that sees it: warned
only after attaching, it would be shown once either way. Lightning's own
deprecation of ``isinstance(treespec, LeafSpec)`` showed twice under
``TrainWatchCallback``, for one.

Each script runs in a fresh interpreter, its stderr counted, unwatched (the
control: once) and watched (``tw.watch``, ``trainwatch run``, the Lightning
callback: once as well). trainwatch still keeps PyTorch's warning about global
hooks around ``torch.compile(module)`` quiet while it is attached, and only then.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[1])

# A helper module of the script's that warns from its own line (its own registry).
PREP = textwrap.dedent(
    """
    import warnings

    def prep(x):
        warnings.warn("prep: the old input layout is deprecated")
        return x
    """
)

# tw.watch, trained, closed; the helper warns before, during and after.
WATCH_LOOP = textwrap.dedent(
    """
    import sys, warnings, torch
    import torch.nn.functional as F
    from torch import nn
    from prep import prep

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    prep(x)
    if sys.argv[1] == "watch":
        import trainwatch as tw
        monitor = tw.watch(model, opt, console=False)
    for _ in range(4):
        loss = F.cross_entropy(model(prep(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if sys.argv[1] == "watch":
        monitor.close()
    prep(x)
    """
)

# A script's own deprecation in __main__ (shown by Python's default filters there),
# called after each step: first shown under the first monitor, then the first is
# closed and a second model watched. (Built after the first optimizer: building one
# imports torch._dynamo, whose imports change the filters.)
TWO_MODELS = textwrap.dedent(
    """
    import sys, warnings, torch
    from torch import nn

    def old_schedule(step):
        warnings.warn("old_schedule is deprecated", DeprecationWarning)
        return 0.1

    torch.manual_seed(0)
    watching = sys.argv[1] == "watch"
    if watching:
        import trainwatch as tw
    for run in range(2):
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = tw.watch(model, opt, console=False) if watching else None
        for step in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            old_schedule(step)
        if monitor is not None:
            monitor.close()
    """
)

LIGHTNING_FIT = textwrap.dedent(
    """
    import sys, warnings, torch
    import lightning.pytorch as pl
    from torch import nn
    from prep import prep

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 1)

        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.mse_loss(self.fc(prep(x)), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    prep(None)
    if sys.argv[1] == "watch":
        from trainwatch.lightning import TrainWatchCallback
        callbacks = [TrainWatchCallback(log_dir="log", console=False)]
    else:
        callbacks = [pl.Callback()]
    trainer = pl.Trainer(
        max_epochs=2, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Net(), loader)
    prep(None)
    """
)

# The script's warning is shown after the model's first compiled pass: tracing a
# graph resets the registries itself (PyTorch enters catch_warnings there).
# Watched after: PyTorch's warning about trainwatch's global hooks around the
# compiled wrapper is kept quiet; after close, the script's own global hook is
# warned about as without trainwatch.
COMPILED = textwrap.dedent(
    """
    import sys, warnings, torch
    from torch import nn
    from prep import prep

    def train(forward, opt, steps):
        for _ in range(steps):
            loss = forward(torch.randn(16, 8)).pow(2).mean()
            prep(None)
            opt.zero_grad()
            loss.backward()
            opt.step()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    compiled = torch.compile(model, backend="eager")
    train(compiled, opt, 1)
    if sys.argv[1] == "watch":
        import trainwatch as tw
        monitor = tw.watch(model, opt, console=False)
    train(compiled, opt, 3)
    if sys.argv[1] == "watch":
        monitor.close()
    prep(None)
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    compiled(torch.randn(16, 8))  # the script's own global hook: PyTorch warns here
    handle.remove()
    """
)


def _run(tmp_path: Path, script: str, *args: str, flags: tuple[str, ...] = ()) -> str:
    (tmp_path / "prep.py").write_text(PREP)
    (tmp_path / "loop.py").write_text(script)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, *flags, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def _shown(stderr: str, text: str) -> int:
    return sum(text in line for line in stderr.splitlines())


_RUN = ("-m", "trainwatch", "run", "--no-console", "--log-dir", "log")


@pytest.mark.parametrize("mode", ["plain", "watch", "run"])
@pytest.mark.parametrize("action", ["default", "once"])
def test_a_helpers_warning_shown_before_watching_is_not_shown_again(tmp_path, mode, action):
    runner = _RUN if mode == "run" else ()
    flags = () if action == "default" else ("-W", "once::UserWarning")
    stderr = _run(tmp_path, WATCH_LOOP, *runner, "loop.py", mode, flags=flags)
    assert _shown(stderr, "UserWarning: prep: the old input layout is deprecated") == 1, stderr


@pytest.mark.parametrize("mode", ["plain", "watch"])
def test_a_mains_deprecation_stays_shown_across_two_watched_models(tmp_path, mode):
    stderr = _run(tmp_path, TWO_MODELS, "loop.py", mode)
    assert _shown(stderr, "DeprecationWarning: old_schedule is deprecated") == 1, stderr


@pytest.mark.parametrize("mode", ["plain", "watch"])
def test_a_warning_shown_before_a_lightning_fit_is_not_shown_again_by_the_callback(tmp_path, mode):
    stderr = _run(tmp_path, LIGHTNING_FIT, "loop.py", mode)
    assert _shown(stderr, "UserWarning: prep: the old input layout is deprecated") == 1, stderr


@pytest.mark.parametrize("mode", ["plain", "watch"])
def test_the_compile_warning_is_quiet_only_while_watched_and_the_scripts_own_stay_shown(
    tmp_path, mode
):
    stderr = _run(tmp_path, COMPILED, "loop.py", mode)
    assert _shown(stderr, "UserWarning: prep: the old input layout is deprecated") == 1, stderr
    # Unwatched there is no global hook until the script's own; watched, none is shown
    # for trainwatch's hooks, and the script's own hook after close is warned about.
    compile_warnings = [line for line in stderr.splitlines() if "global hooks on modules" in line]
    assert len(compile_warnings) == 1, stderr
    assert "loop.py" in compile_warnings[0]
