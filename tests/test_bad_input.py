"""Bad input to trainwatch itself: a clear error naming the problem, nothing half-attached.

Each mistake is refused where it is made (``tw.watch``, the callback's
constructor, ``trainwatch run``'s start), before any hook is attached or any
file is written.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainwatch as tw
from tests.conftest import TinyNet
from tests.test_lifecycle import NO_HOOKS, hook_counts
from trainwatch.cli import main as cli_main


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("zero_gradient:\n  patiense: 2\n", r"zero_gradient\.patiense: unknown key.*patience"),
        ("zero_gradeint:\n  patience: 2\n", r"zero_gradeint: unknown key"),
        ("zero_gradient:\n  patience: three\n", r"zero_gradient\.patience: expected a number"),
        ("zero_gradient:\n  patience: 0\n", r"zero_gradient\.patience: 0 is below the minimum 1"),
        ("constant_output:\n  every: -5\n", r"constant_output\.every: -5 is below the minimum"),
        ("halt_on: [nan]\n", r"halt_on: unknown rule id 'nan'"),
        ("- just\n- a list\n", r"must hold a mapping at the top level"),
    ],
)
def test_bad_config_file_is_refused_by_watch_naming_the_key(tmp_path, model, yaml_text, message):
    path = tmp_path / "trainwatch.yaml"
    path.write_text(yaml_text)
    log_dir = tmp_path / "log"
    with pytest.raises(tw.ConfigError, match=message):
        tw.watch(model, config=path, log_dir=log_dir, console=False)
    assert hook_counts(model) == NO_HOOKS
    assert not log_dir.exists()  # no empty alerts file left behind


def test_log_dir_that_cannot_be_written_is_refused_naming_log_dir(tmp_path, model):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(tw.WatchError, match=r"log_dir: cannot write alerts into .*a-file"):
        tw.watch(model, opt, log_dir=blocker / "run", console=False)
    assert hook_counts(model, [opt]) == NO_HOOKS
    with pytest.raises(tw.WatchError, match=r"log_dir: expected a path"):
        tw.watch(model, opt, log_dir=42, console=False)
    with tw.watch(model, opt, console=False):  # the model is free to be watched
        pass


def test_refused_watch_writes_no_files(tmp_path):
    log_dir = tmp_path / "log"
    with pytest.raises(tw.WatchError, match="has no parameters"):
        tw.watch(nn.ReLU(), log_dir=log_dir, console=False)
    assert not log_dir.exists()


def test_second_monitor_on_the_same_model_is_a_clear_error(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False):
        before = hook_counts(model, [opt])
        with pytest.raises(tw.WatchError, match="already watched"):
            tw.watch(model, opt, console=False)
        with pytest.raises(tw.WatchError, match="already watched"):
            tw.watch(model.fc1, console=False)  # a part of a watched model too
        assert hook_counts(model, [opt]) == before  # nothing half-attached
    with tw.watch(model, opt, console=False):  # after close, watching again is fine
        pass


def test_bad_arguments_are_rejected_before_anything_attaches(model):
    with pytest.raises(tw.WatchError, match=r"torch\.nn\.Module"):
        tw.watch("not a model")
    with pytest.raises(tw.WatchError, match="Optimizer"):
        tw.watch(model, optimizer=[object()], console=False)
    assert hook_counts(model) == NO_HOOKS


def test_model_without_parameters_is_a_clear_error():
    with pytest.raises(tw.WatchError, match="has no parameters"):
        tw.watch(nn.ReLU(), console=False)


def test_optimizer_of_another_model_is_a_clear_error(model):
    other = TinyNet()
    opt = torch.optim.SGD(other.parameters(), lr=0.01)
    with pytest.raises(tw.WatchError, match="none of them belongs to the watched model"):
        tw.watch(model, opt, console=False)
    assert hook_counts(model, [opt]) == NO_HOOKS
    with tw.watch(model, console=False) as monitor:
        with pytest.raises(tw.WatchError, match="another model"):
            monitor.add_optimizer(opt)


def test_trainwatch_run_refuses_a_bad_config_and_log_dir_before_running_the_script(
    tmp_path, capsys
):
    script = tmp_path / "train.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("zero_gradient:\n  patiense: 2\n")
    assert cli_main(["run", "--config", str(bad), str(script)]) == 2
    assert "zero_gradient.patiense: unknown key" in capsys.readouterr().err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli_main(["run", "--log-dir", str(blocker / "run"), str(script)]) == 2
    assert "--log-dir: cannot write alerts" in capsys.readouterr().err
    assert not marker.exists()  # the script never ran half-watched
