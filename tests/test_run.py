"""``trainwatch run``: unmodified scripts, written here, watched from outside.

In-process runs (``run_script``) where only alerts matter; a subprocess where
the exit status and the printed traceback are the point.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch.nn.modules import module as module_hooks
from torch.optim import optimizer as optimizer_hooks

from trainwatch.runner import run_script

NET = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, inputs=8, hidden=16, outputs=1):
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, outputs)
        self.detach_fc1 = False

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.detach_fc1:
            h = h.detach()
        return self.head(torch.tanh(self.fc2(h)))


def batch(step, n=32, inputs=8):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, inputs, generator=g)
    return x, x[:, :1].sin()
"""

LOOP = """
import sys
import torch
from netdef import Net, batch

torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 12
BUG_AT = int(sys.argv[2]) if len(sys.argv) > 2 else STEPS
for step in range(STEPS):
    x, y = batch(step)
    if step < BUG_AT:
        opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
print("finished", STEPS)
"""


def write(tmp_path: Path, name: str, body: str) -> Path:
    (tmp_path / "netdef.py").write_text(NET)
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def alerts(log_dir: Path) -> list[dict]:
    lines = (log_dir / "alerts.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def rules(log_dir: Path, severities=("warning", "error")) -> set[str]:
    return {a["rule"] for a in alerts(log_dir) if a["severity"] in severities}


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainwatch", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


@pytest.fixture(autouse=True)
def _forget_script_modules():
    """Each test's scripts import their own ``netdef``; and no hook may leak out."""
    yield
    sys.modules.pop("netdef", None)
    assert not module_hooks._global_forward_pre_hooks
    assert not module_hooks._global_forward_hooks
    assert not optimizer_hooks._global_optimizer_pre_hooks
    assert not optimizer_hooks._global_optimizer_post_hooks


def test_planted_bug_is_found_with_names_relative_to_the_model(tmp_path, capsys):
    script = write(tmp_path, "train.py", LOOP)
    code = run_script(script, ["12", "4"], log_dir=tmp_path / "log")
    assert code == 0
    found = alerts(tmp_path / "log")
    assert [(a["rule"], a["step"]) for a in found] == [("accumulated_gradient", 4)]
    assert found[0]["data"]["modules"] == ["fc1", "fc2", "head"]
    assert found[0]["data"]["model"] == "Net"
    err = capsys.readouterr().err
    assert "step 4 ERROR accumulated_gradient" in err
    assert "12 steps watched" in err


def test_clean_script_exits_zero_without_alerts(tmp_path, capsys):
    script = write(tmp_path, "train.py", LOOP)
    assert run_script(script, ["10"], log_dir=tmp_path / "log", fail_on="warning") == 0
    assert alerts(tmp_path / "log") == []
    out = capsys.readouterr()
    assert "finished 10" in out.out
    assert "10 steps watched" in out.err and "no alerts" in out.err


def test_script_sees_its_own_argv_name_and_path(tmp_path, capsys):
    script = write(
        tmp_path,
        "args.py",
        """
        import sys
        import netdef  # importable: the script's directory is sys.path[0]
        assert __name__ == "__main__", __name__
        print("ARGV", sys.argv)
        print("PATH0", sys.path[0])
        """,
    )
    args = ["--lr", "3e-4", "--fail-on", "x", "--max-steps", "2"]
    assert run_script(script, args, log_dir=tmp_path / "log", console=False) == 0
    out = capsys.readouterr().out
    assert f"ARGV {[str(script), *args]}" in out
    assert f"PATH0 {tmp_path}" in out
    assert sys.argv[0] != str(script)  # restored


def test_a_script_named_by_a_relative_path_sees_its_absolute_file_as_under_python(
    tmp_path, capsys, monkeypatch
):
    """python gives __main__ an absolute __file__ whatever the path typed: a script
    that changes directory and then opens files beside itself works the same."""
    write(
        tmp_path,
        "where.py",
        """
        import os
        os.chdir(os.path.dirname(os.path.dirname(__file__)))
        print("FILE", __file__)
        print("BESIDE", os.path.exists(os.path.join(os.path.dirname(__file__), "netdef.py")))
        """,
    )
    monkeypatch.chdir(tmp_path)
    assert run_script(Path("where.py"), log_dir=tmp_path / "log", console=False) == 0
    out = capsys.readouterr().out
    assert f"FILE {tmp_path / 'where.py'}" in out
    assert "BESIDE True" in out


def test_sys_exit_code_is_passed_through(tmp_path):
    script = write(tmp_path, "exits.py", "import sys\nsys.exit(7)\n")
    assert run_script(script, log_dir=tmp_path / "log", console=False) == 7


def test_gan_with_two_optimizers_one_built_after_the_first_forward(tmp_path, capsys):
    script = write(
        tmp_path,
        "gan.py",
        """
        import torch
        from torch import nn


        class Generator(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(4, 16)
                self.out = nn.Linear(16, 8)

            def forward(self, z):
                return self.out(torch.relu(self.fc1(z)))


        class Discriminator(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(8, 16)
                self.out = nn.Linear(16, 1)

            def forward(self, x):
                return self.out(torch.relu(self.fc1(x)))


        torch.manual_seed(0)
        G, D = Generator(), Discriminator()
        opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
        G(torch.randn(2, 4))  # a first forward before G's optimizer exists
        G.fc1.weight.requires_grad_(False)  # the planted bug: frozen inside opt_g
        opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
        bce = nn.BCEWithLogitsLoss()
        for step in range(8):
            real = torch.randn(16, 8) + 2.0
            fake = G(torch.randn(16, 4))
            opt_d.zero_grad()
            d_loss = bce(D(real), torch.ones(16, 1)) + bce(D(fake.detach()), torch.zeros(16, 1))
            d_loss.backward()
            opt_d.step()
            opt_g.zero_grad()
            g_loss = bce(D(fake), torch.ones(16, 1))
            g_loss.backward()
            opt_g.step()
        """,
    )
    assert run_script(script, log_dir=tmp_path / "log") == 0
    found = alerts(tmp_path / "log")
    assert [(a["rule"], a["module"], a["data"]["model"]) for a in found] == [
        ("frozen_in_optimizer", "fc1", "Generator")
    ]
    err = capsys.readouterr().err
    assert "frozen_in_optimizer [Generator:fc1]" in err
    assert "8 steps watched" in err
    assert "Discriminator:fc1" in err  # both models' gradient norms in the summary


MANUAL = """
import sys
import torch
from netdef import Net, batch

torch.manual_seed(0)
model = Net()
model.detach_fc1 = "detach" in sys.argv
STEPS = 10
for step in range(STEPS):
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.05 * p.grad
                p.grad.zero_()
print("finished", STEPS)
"""


BY_TORCH_FUNC = """
import torch
from torch.func import functional_call, grad
from netdef import Net, batch

torch.manual_seed(0)
model = Net()


def loss_of(params, x, y):
    return torch.nn.functional.mse_loss(functional_call(model, params, (x,)), y)


for step in range(6):
    x, y = batch(step)
    params = {name: p.detach() for name, p in model.named_parameters()}
    grads = grad(loss_of)(params, x, y)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p -= 0.05 * grads[name]
print("finished")
"""


def test_a_run_that_watched_no_step_says_so_at_the_end(tmp_path, capsys):
    """Gradients taken with torch.func and applied by hand: no optimizer steps, no
    backward writes .grad, so run watches nothing; the end says why, not silence."""
    script = write(tmp_path, "by_func.py", BY_TORCH_FUNC)
    assert run_script(script, log_dir=tmp_path / "log") == 0
    err = capsys.readouterr().err
    assert "no training step watched" in err and "tw.watch(model)" in err


def test_manual_sgd_without_an_optimizer_is_clean(tmp_path, capsys):
    script = write(tmp_path, "manual.py", MANUAL)
    assert run_script(script, log_dir=tmp_path / "log") == 0
    assert alerts(tmp_path / "log") == []  # no not_optimized, no zero_gradient
    err = capsys.readouterr().err
    assert "10 steps watched" in err and "no alerts" in err
    assert "no training step watched" not in err


def test_a_manual_sgd_run_leaves_no_torch_function_mode_behind(tmp_path):
    """The broadcast audit's mode is popped before the audit is let go: a mode left
    on the stack would blind every later audit in the process."""
    import torch

    script = write(tmp_path, "manual.py", MANUAL)
    assert run_script(script, log_dir=tmp_path / "log", console=False) == 0
    assert torch._C._len_torch_function_stack() == 0


def test_manual_sgd_steps_come_from_backward_passes(tmp_path, capsys):
    script = write(tmp_path, "manual.py", MANUAL)
    assert run_script(script, ["detach"], log_dir=tmp_path / "log") == 0
    found = alerts(tmp_path / "log")
    assert [(a["rule"], a["module"], a["step"]) for a in found] == [("zero_gradient", "fc1", 0)]
    assert "10 steps watched" in capsys.readouterr().err


def test_a_hand_trained_model_gets_no_hook_per_parameter(tmp_path, capsys):
    """Its steps are told by the end of each backward through the model, from one
    tensor hook per pass: of its parameters only one carries a hook of trainwatch's
    (for backward passes that come another way), never one each."""
    body = MANUAL.replace(
        'print("finished", STEPS)',
        "hooks = sum(len(p._post_accumulate_grad_hooks or {}) + len(p._backward_hooks or {})"
        ' for p in model.parameters())\nprint("parameter hooks", hooks)',
    )
    script = write(tmp_path, "manual_hooks.py", body)
    assert run_script(script, log_dir=tmp_path / "log") == 0
    captured = capsys.readouterr()
    assert "parameter hooks 1" in captured.out
    assert "10 steps watched" in captured.err and alerts(tmp_path / "log") == []


def test_max_steps_stops_the_script_cleanly(tmp_path, capsys):
    script = write(tmp_path, "train.py", LOOP)
    assert run_script(script, ["1000"], log_dir=tmp_path / "log", max_steps=5) == 0
    out = capsys.readouterr()
    assert "finished" not in out.out
    assert "5 steps watched" in out.err
    assert "stopped after 5 steps" in out.err


def test_max_steps_in_a_hand_written_loop(tmp_path, capsys):
    script = write(tmp_path, "manual.py", MANUAL)
    assert run_script(script, log_dir=tmp_path / "log", max_steps=3) == 0
    out = capsys.readouterr()
    assert "finished" not in out.out
    assert "3 steps watched" in out.err


def test_closure_optimizer_first_called_inside_step(tmp_path):
    script = write(
        tmp_path,
        "lbfgs.py",
        """
        import torch
        from netdef import Net, batch

        torch.manual_seed(0)
        model = Net()
        model.detach_fc1 = True
        opt = torch.optim.LBFGS(model.parameters(), max_iter=2)
        x, y = batch(0)

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        for _ in range(4):
            opt.step(closure)
        """,
    )
    assert run_script(script, log_dir=tmp_path / "log", console=False) == 0
    found = alerts(tmp_path / "log")
    assert [(a["rule"], a["module"], a["step"]) for a in found] == [("zero_gradient", "fc1", 0)]


def test_config_preset_by_path_halts_and_the_error_passes_through(tmp_path, capsys):
    script = write(tmp_path, "train.py", LOOP)
    strict = Path(__file__).resolve().parent.parent / "configs" / "strict.yaml"
    code = run_script(script, ["12", "3"], log_dir=tmp_path / "log", config=strict)
    assert code == 1
    err = capsys.readouterr().err
    assert "TrainingHealthError: accumulated_gradient at step 3" in err
    assert rules(tmp_path / "log") == {"accumulated_gradient"}


def test_keyboard_interrupt_flushes_alerts(tmp_path, capsys):
    script = write(
        tmp_path,
        "interrupted.py",
        LOOP + "\nraise KeyboardInterrupt\n",
    )
    assert run_script(script, ["6", "2"], log_dir=tmp_path / "log") == 130
    assert rules(tmp_path / "log") == {"accumulated_gradient"}
    assert "KeyboardInterrupt" in capsys.readouterr().err


def test_a_script_calling_tw_watch_itself_takes_over_its_model(tmp_path, capsys):
    script = write(
        tmp_path,
        "own.py",
        """
        import io
        import torch
        import trainwatch as tw
        from netdef import Net, batch

        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        model(torch.zeros(1, 8))  # a forward before tw.watch: trainwatch run saw it first
        with tw.watch(model, opt, console=io.StringIO()) as monitor:
            for step in range(4):
                x, y = batch(step)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        assert monitor.step_count == 4
        """,
    )
    assert run_script(script, log_dir=tmp_path / "log") == 0
    assert "steps watched" not in capsys.readouterr().err


@pytest.mark.slow
def test_planted_bug_fails_the_gate_from_the_console_script(tmp_path):
    """The installed ``trainwatch`` command, the default log dir, and exit status 3."""
    write(tmp_path, "train.py", LOOP)
    trainwatch = Path(sys.executable).with_name("trainwatch")
    done = subprocess.run(
        [str(trainwatch), "run", "--fail-on", "warning", "train.py", "8", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 3, done.stderr
    assert "finished 8" in done.stdout
    assert "step 3 ERROR accumulated_gradient" in done.stderr
    (log,) = (tmp_path / "runs" / "trainwatch").iterdir()
    assert rules(log) == {"accumulated_gradient"}


def test_fail_on_error_without_console(tmp_path, capsys):
    script = write(tmp_path, "train.py", LOOP)
    code = run_script(script, ["8", "3"], log_dir=tmp_path / "log", fail_on="error", console=False)
    assert code == 3
    assert "accumulated_gradient" not in capsys.readouterr().err
    assert rules(tmp_path / "log") == {"accumulated_gradient"}


def test_fail_on_error_ignores_warnings(tmp_path):
    script = write(tmp_path, "manual.py", MANUAL)
    code = run_script(script, ["detach"], log_dir=tmp_path / "log", fail_on="error", console=False)
    assert code == 0  # zero_gradient is a warning
    assert rules(tmp_path / "log") == {"zero_gradient"}


@pytest.mark.slow
def test_a_crash_passes_its_traceback_and_status_through_with_alerts_flushed(tmp_path):
    write(
        tmp_path,
        "crash.py",
        LOOP + "\nraise ValueError('boom after training')\n",
    )
    log = tmp_path / "log"
    done = cli(
        "run", "--log-dir", str(log), "--fail-on", "warning", "crash.py", "6", "2", cwd=tmp_path
    )
    assert done.returncode == 1  # the script's failure, not the gate's 3
    assert "Traceback (most recent call last):" in done.stderr
    assert 'crash.py", line' in done.stderr
    assert "ValueError: boom after training" in done.stderr
    assert "runpy" not in done.stderr and "runner.py" not in done.stderr
    assert rules(log) == {"accumulated_gradient"}


@pytest.mark.slow
def test_lightning_script_is_watched_through_the_global_hooks(tmp_path, capsys):
    pytest.importorskip("lightning")
    script = write(
        tmp_path,
        "lit.py",
        """
        import lightning as L
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset


        class Lit(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(8, 16)
                self.head = nn.Linear(16, 1)

            def forward(self, x):
                return self.head(torch.relu(self.fc1(x).detach()))  # planted: fc1 cut out

            def training_step(self, batch, _):
                x, y = batch
                return nn.functional.mse_loss(self(x), y)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.05)


        x = torch.randn(256, 8)
        data = DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=32)
        trainer = L.Trainer(
            max_steps=50, accelerator="cpu", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(Lit(), data)
        """,
    )
    assert run_script(script, log_dir=tmp_path / "log", max_steps=4) == 0
    found = alerts(tmp_path / "log")
    # The optimizer steps with a closure that first calls the model: step 0 still counts.
    assert [(a["rule"], a["module"], a["step"]) for a in found] == [("zero_gradient", "fc1", 0)]
    assert "4 steps watched" in capsys.readouterr().err


def test_a_failure_inside_trainwatch_is_reported_once_and_training_goes_on(tmp_path):
    script = write(
        tmp_path,
        "odd.py",
        """
        import torch
        from torch import nn


        class Odd(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 1)

            def parameters(self, recurse=True):  # breaks trainwatch's discovery, not training
                raise RuntimeError("Odd hides its parameters")

            def forward(self, x):
                return self.lin(x)


        model = Odd()
        opt = torch.optim.SGD(model.lin.parameters(), lr=0.1)
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
        print("trained")
        """,
    )
    assert run_script(script, log_dir=tmp_path / "log", console=False, fail_on="warning") == 0
    found = alerts(tmp_path / "log")
    assert [(a["rule"], a["data"]["component"]) for a in found] == [
        ("internal_error", "trainwatch run: model discovery")
    ]


def test_usage_errors_exit_2_before_the_script_runs(tmp_path, capsys):
    from trainwatch.cli import main

    script = write(tmp_path, "train.py", LOOP)
    bad = tmp_path / "bad.yaml"
    bad.write_text("zero_gradient:\n  patiense: 2\n")
    assert main(["run", "--config", str(bad), str(script)]) == 2
    assert main(["run", str(tmp_path / "missing.py")]) == 2
    captured = capsys.readouterr()
    assert "zero_gradient.patiense: unknown key" in captured.err
    assert "can't open file" in captured.err
    assert "finished" not in captured.out


@pytest.mark.slow
def test_ctrl_c_flushes_alerts_and_exits_130(tmp_path):
    import signal

    write(
        tmp_path,
        "forever.py",
        """
        import torch
        from netdef import Net, batch

        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        step = 0
        while True:
            x, y = batch(step)
            if step < 2:
                opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if step == 4:
                print("READY", flush=True)
            step += 1
        """,
    )
    log = tmp_path / "log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainwatch", "run", "--log-dir", str(log), "forever.py"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        # A suite started as a background job (``pytest &``) hands its children SIGINT
        # ignored, and Python then keeps it ignored: Ctrl-C as a terminal sends it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout.readline().strip() == "READY"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "KeyboardInterrupt" in err
    assert "steps watched" in err  # the summary still printed
    assert rules(log) == {"accumulated_gradient"}
    assert json.loads((log / "alert_counts.json").read_text())["counts"][0]["count"] >= 2


def test_a_nan_made_in_the_first_forward_is_found_there(tmp_path):
    from trainwatch.rules import RULE_CLASSES

    if "nonfinite_forward" not in {cls.id for cls in RULE_CLASSES}:
        pytest.skip("rule nonfinite_forward not built yet")
    script = write(
        tmp_path,
        "nan.py",
        """
        import torch
        from torch import nn


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(8, 16)
                self.fc2 = nn.Linear(16, 1)

            def forward(self, x):
                return self.fc2(torch.log(torch.relu(self.fc1(x)) - 1))  # NaN in the root's op


        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            model(torch.randn(32, 8)).pow(2).mean().backward()
            opt.step()
        """,
    )
    assert run_script(script, log_dir=tmp_path / "log", console=False) == 0
    first = alerts(tmp_path / "log")[0]
    assert (first["rule"], first["module"], first["step"]) == ("nonfinite_forward", "", 0)


def test_global_forward_hooks_come_off_once_models_train_and_a_later_model_is_still_found(
    tmp_path, capsys
):
    """Global forward hooks cost every module call: on only until every model found
    steps with an optimizer, and again when an optimizer of an unknown model steps."""
    script = write(
        tmp_path,
        "phases.py",
        NET
        + """
import sys
from torch.nn.modules import module as hooks

def hooked():
    return len(hooks._global_forward_hooks) + len(hooks._global_forward_pre_hooks)

def train(model, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 1)).backward()
        opt.step()

torch.manual_seed(0)
train(Net(), 6)
settled = hooked()
second = Net()
second.detach_fc1 = True  # a bug in the model of the second phase only
train(second, 6)
print("hooked after settling:", settled)
""",
    )
    assert run_script(script, log_dir=tmp_path / "log", console=False) == 0
    assert "hooked after settling: 0" in capsys.readouterr().out
    alerts = [json.loads(line) for line in (tmp_path / "log" / "alerts.jsonl").open()]
    assert [(a["rule"], a["module"], a["data"]["model"]) for a in alerts] == [
        ("zero_gradient", "fc1", "Net#2")
    ]


SECOND_MODEL = """
import torch
from netdef import Net, batch

torch.manual_seed(0)
for phase in range(2):
    # A second model, built after the first one trained (the watcher had settled).
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(8):
        x, y = batch(step)
        if phase == 0 or step < 5:
            opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
"""


def test_a_model_built_after_the_first_settled_is_counted_from_its_first_step(tmp_path):
    script = write(tmp_path, "train.py", SECOND_MODEL)
    assert run_script(script, log_dir=tmp_path / "log", console=False) == 0
    found = [(a["rule"], a["step"], a["data"]["model"]) for a in alerts(tmp_path / "log")]
    assert found == [("accumulated_gradient", 5, "Net#2")]


NAN_FROM = """
import sys
import torch
from torch import nn


class LogOfNegatives(nn.Module):
    def __init__(self):
        super().__init__()
        self.bug_on = False

    def forward(self, h):
        return torch.log(h) if self.bug_on else h


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), LogOfNegatives(), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
BUG_AT = int(sys.argv[1])
for step in range(6):
    model[1].bug_on = step >= BUG_AT
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("bug_at", [0, 3])
def test_a_nan_born_in_forward_is_one_alert_even_at_the_first_step(tmp_path, bug_at):
    # At step 0 the monitor is made inside the model's first call and sees only
    # that pass's end: the gradients it poisons are still the forward's knock-on.
    script = write(tmp_path, "train.py", NAN_FROM)
    assert run_script(script, [str(bug_at)], log_dir=tmp_path / "log", console=False) == 0
    found = [(a["rule"], a["step"], a["module"]) for a in alerts(tmp_path / "log")]
    assert found == [("nonfinite_forward", bug_at, "1")]


def test_a_clean_run_of_the_nan_script_has_no_alert(tmp_path):
    script = write(tmp_path, "train.py", NAN_FROM)
    assert run_script(script, ["6"], log_dir=tmp_path / "log", console=False) == 0
    assert alerts(tmp_path / "log") == []


VALIDATED = """
import sys
import torch
from netdef import Net, batch

torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
xv, yv = batch(99, n=40)
yv = yv.squeeze(-1)  # a dataset of scalars yields (N,) targets
for step in range(10):
    x, y = batch(step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if step % 5 == 4:
        model.eval()
        with torch.no_grad():
            pred = model(xv)
            if sys.argv[1] == "bug":
                val = ((pred - yv) ** 2).mean()
            else:
                val = ((pred.squeeze(-1) - yv) ** 2).mean()
        model.train()
        print("val", round(val.item(), 3))
"""


@pytest.mark.parametrize("bug", [True, False], ids=["n1_against_n", "squeezed"])
def test_a_validation_loss_broadcast_in_an_unmodified_script(tmp_path, bug):
    script = write(tmp_path, "validated.py", VALIDATED)
    code = run_script(script, ["bug" if bug else "ok"], log_dir=tmp_path / "log", console=False)
    assert code == 0
    found = [(a["rule"], a["step"], a["data"].get("phase")) for a in alerts(tmp_path / "log")]
    assert found == ([("broadcast", 5, "evaluation")] if bug else [])
