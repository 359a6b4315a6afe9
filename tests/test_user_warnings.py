"""The user's own warnings, under trainwatch, are shown as often and name the same line
as without it.

Python shows a warning once per code location from a registry that any change
of the filters through the warnings API wipes for the whole process; trainwatch
makes none (tests/test_warnings_shown_before_watching_stay_shown.py). Its
loss audits run the loss's ops from a function mode, so a warning of theirs
is warned again from the line that called the op; its own re-runs of the model
(the stalled-training probe's first batch, a NaN replay) show no warning and
leave no registry mark.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

LOOP = textwrap.dedent(
    """
    import sys, warnings, torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    if sys.argv[1] == "watch":
        import trainwatch as tw
        monitor = tw.watch(model, opt, console=False)
    for step in range(40):
        x = torch.randn(16, 8)
        y = x.sum(1)
        if sys.argv[2] == "mismatched_loss":
            loss = loss_fn(model(x), y)  # torch warns: "Using a target size ..."
        else:
            loss = loss_fn(model(x), y.unsqueeze(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        warnings.warn("the learning-rate schedule is deprecated")
    """
)


@pytest.mark.parametrize("mode", ["plain", "watch", "run"])
@pytest.mark.parametrize("loss", ["matching_loss", "mismatched_loss"])
def test_a_warning_the_loop_raises_every_step_is_printed_once_over_many_steps(tmp_path, mode, loss):
    """Once per line, as Python's default filter has it: the loop's own warning, and
    torch's own for a mismatched loss (a bug of the user's, left beside the control)."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    runner = ["-m", "trainwatch", "run", "--no-console", "--log-dir", str(tmp_path / "log")]
    done = subprocess.run(
        [sys.executable, *(runner if mode == "run" else []), str(script), mode, loss],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    shown = done.stderr.splitlines()
    # Each warning prints its line and the source line below it.
    assert sum("UserWarning: the learning-rate schedule" in line for line in shown) == 1
    targets = [line for line in shown if "UserWarning: Using a target size" in line]
    assert len(targets) == (loss == "mismatched_loss"), targets
    assert all("trainwatch" not in line for line in targets), targets


def _regression_steps(model: nn.Module, steps: int) -> None:
    """Steps whose loss takes the spread of one element: a C++ warning each time."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen)
        y = x.sum(1, keepdim=True)
        out = model(x)
        scale = torch.nan_to_num(y[-1:].std(), nan=1.0)  # THE SPREAD LINE
        loss = F.mse_loss(out / scale, y / scale)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _spread_line() -> int:
    lines, first = inspect.getsourcelines(_regression_steps)
    return first + next(i for i, line in enumerate(lines) if "THE SPREAD LINE" in line)


@pytest.mark.parametrize("watched", [False, True])
def test_a_cpp_warning_in_the_loss_during_the_audit_names_the_users_line(quiet_watch, watched):
    """``torch.std`` of one element warns from C++; the broadcast audit's mode runs it
    in the first steps, and the warning still names the user's line, not the mode's."""
    model = nn.Linear(4, 1)
    if watched:
        quiet_watch(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _regression_steps(model, 3)
    where = {(w.filename, w.lineno) for w in seen if "degrees of freedom" in str(w.message)}
    assert where == {(__file__, _spread_line())}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the user's own filter still applies
        with pytest.raises(UserWarning, match="degrees of freedom"):
            _regression_steps(model, 1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class CheckpointedNet(nn.Module):
    """An embedding, then blocks under a reentrant checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 20)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return self.head(x)


@pytest.mark.parametrize("frozen_embedding", [False, True])
def test_trainwatchs_rerun_of_a_reentrant_checkpoint_leaves_torchs_warning_to_the_users_passes(
    quiet_watch, frozen_embedding
):
    """The stalled-training probe re-runs the first batch without gradients: under a
    reentrant checkpoint torch would warn "None of the inputs have requires_grad=True",
    the sign of the real pitfall (a frozen embedding before the checkpoint), shown
    for that one alone."""
    torch.manual_seed(0)
    model = CheckpointedNet()
    model.emb.weight.requires_grad_(not frozen_embedding)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    quiet_watch(model, opt)
    data = torch.randint(0, 20, (4, 9))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # once per line, as outside a test
        for _ in range(3):
            logits = model(data[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 20), data[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    found = [w for w in seen if "None of the inputs have requires_grad" in str(w.message)]
    assert len(found) == frozen_embedding, [str(w.message) for w in seen]


class CalibratedNet(nn.Module):
    """Warns when evaluated before it was calibrated: its own once-per-line warning."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            warnings.warn("evaluating an uncalibrated model", stacklevel=1)
        return self.fc(x)


@pytest.mark.parametrize("watched", [False, True])
def test_a_warning_of_trainwatchs_own_rerun_leaves_the_users_later_pass_to_show_it(
    quiet_watch, watched
):
    """The probe re-runs the first batch in eval mode, where the model warns: not shown
    then, and the user's own evaluation after training still shows it, once."""
    torch.manual_seed(0)
    model = CalibratedNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    if watched:
        quiet_watch(model, opt)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # once per line, as outside a test
        for _ in range(3):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert [str(w.message) for w in seen] == []
        model.eval()
        with torch.no_grad():
            model(x)
            model(x)
    assert [str(w.message) for w in seen] == ["evaluating an uncalibrated model"]


def test_the_users_showwarning_is_put_back_and_still_used(quiet_watch):
    """A ``warnings.showwarning`` of the user's (a logger's) sees the warnings as before."""
    shown: list[str] = []

    def log(message, category, filename, lineno, file=None, line=None):
        shown.append(f"{filename.rsplit('/', 1)[-1]}:{lineno}: {message}")

    model = nn.Linear(4, 1)
    quiet_watch(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = log
        _regression_steps(model, 3)
        assert warnings.showwarning is log
    where = f"test_user_warnings.py:{_spread_line()}: std(): degrees of freedom"
    assert len(shown) == 3 and all(line.startswith(where) for line in shown), shown


class _ShortSourceLoader:
    """A module loader whose source is shorter than the code run in its globals."""

    def get_source(self, name: str) -> str:
        return "x = 1\n"


def test_a_loss_warning_from_code_run_by_exec_in_a_module_with_a_loader_does_not_break_training(
    quiet_watch,
):
    # Code handed to exec() in a module's globals (a notebook runner, a job launcher):
    # the warning names a line past the end of that module's own source.
    source = "\n" * 30 + textwrap.dedent(
        """
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        """
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    namespace = {
        "__name__": "train_job",
        "__loader__": _ShortSourceLoader(),
        "F": F,
        "model": model,
        "opt": opt,
        "x": torch.randn(16, 4),
        "y": torch.randn(16),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(source, "train_job.py", "exec"), namespace)
    assert monitor.step_count == 3
    assert [a.rule for a in monitor.alerts] == ["broadcast"]
    shown = [w for w in caught if "target size" in str(w.message)]
    assert shown and shown[0].filename == "train_job.py"
