"""Config: defaults in code equal configs/default.yaml; bad keys fail naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import trainwatch as tw
from trainwatch.config import load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_default_yaml_equals_the_defaults_in_code():
    assert yaml.safe_load((CONFIGS / "default.yaml").read_text()) == tw.Config().to_dict()


@pytest.mark.parametrize("preset", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_preset_loads(preset):
    assert isinstance(load_config(CONFIGS / preset), tw.Config)


def test_presets_differ_as_documented():
    strict = load_config(CONFIGS / "strict.yaml")
    minimal = load_config(CONFIGS / "minimal.yaml")
    assert strict.zero_gradient.patience == 1 and "accumulated_gradient" in strict.halt_on
    assert not minimal.accumulated_gradient.enabled and not minimal.console.summary


def test_round_trip_through_dict():
    config = load_config({"zero_gradient": {"patience": 7}, "halt_on": ["zero_gradient"]})
    assert tw.Config.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"zero_gradeint": {}}, r"zero_gradeint: unknown key; allowed keys: .*zero_gradient"),
        ({"zero_gradient": {"patiense": 2}}, r"zero_gradient.patiense: unknown key.*patience"),
        ({"zero_gradient": {"patience": 0}}, r"zero_gradient.patience: 0 is below the minimum 1"),
        ({"zero_gradient": {"patience": "3"}}, r"zero_gradient.patience: expected a number"),
        ({"zero_gradient": {"patience": 2.5}}, r"zero_gradient.patience: expected an integer"),
        ({"zero_gradient": {"severity": "fatal"}}, r"severity: 'fatal' is not allowed.*warning"),
        ({"zero_gradient": {"enabled": "yes"}}, r"zero_gradient.enabled: expected true or false"),
        ({"halt_on": ["nan"]}, r"halt_on: unknown rule id 'nan'; allowed: .*nonfinite_loss"),
        ({"halt_on": "zero_gradient"}, r"halt_on: expected a list"),
        ({"readback": "sometimes"}, r"readback: 'sometimes' is not allowed; allowed values"),
    ],
)
def test_bad_config_fails_at_load_time_naming_the_key(values, message):
    with pytest.raises(tw.ConfigError, match=message):
        load_config(values)


def test_bad_yaml_file_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("console:\n  colour: true\n")
    with pytest.raises(tw.ConfigError, match=r"console.colour: unknown key"):
        load_config(path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(tw.ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")


def test_overrides_set_single_keys_on_top_of_a_file():
    config = load_config(
        CONFIGS / "strict.yaml",
        {
            "zero_gradient": {"patience": 4},
            "not_optimized": False,
            "console__top_layers": 2,
            "frozen_in_optimizer.severity": "info",
        },
    )
    assert config.zero_gradient.patience == 4
    assert config.zero_gradient.severity == "error"  # kept from the file
    assert not config.not_optimized.enabled
    assert config.console.top_layers == 2
    assert config.frozen_in_optimizer.severity == "info"


def test_watch_rejects_a_bad_override_before_attaching(model):
    with pytest.raises(tw.ConfigError, match=r"zero_gradient\.patience"):
        tw.watch(model, zero_gradient={"patience": -1})
    with tw.watch(model, console=False):  # nothing was left attached
        pass


def test_disabled_rule_stays_silent(model):
    import torch

    from tests.conftest import train

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False, accumulated_gradient=False) as monitor:
        train(model, opt, 5, zero_grad_until=1)
    assert monitor.alerts == []
