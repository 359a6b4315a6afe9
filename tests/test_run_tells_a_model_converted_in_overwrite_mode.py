"""A model converted in overwrite mode after its optimizer was built, under ``trainwatch run``.

With ``torch.__future__.set_overwrite_module_params_on_conversion(True)``,
``model.double()``, ``.half()`` or ``.to(dtype)`` put new Parameter objects in
the model; an optimizer built before holds the old ones, and the model never
trains. ``tw.watch`` tells it at the first step. ``trainwatch run``, which
meets the model only after the conversion, told it two steps late as a model
replaced by a copy (``data.kind: replaced_model``), with advice for
``copy.deepcopy`` or a new instance loaded. Now it is told at step 0 as the
conversion it is (``data.kind: converted_in_overwrite_mode``): build the
optimizer after the conversion, or turn overwrite mode off.

Clean beside each: overwrite mode on, the optimizer built after the
conversion. A new instance converted in place of the model stays a replaced
model; a model first called before its conversion is told as ``tw.watch``
tells it. Under Lightning, which converts the model itself (``precision=
"64-true"``) before ``configure_optimizers``, an optimizer built in
``__init__`` is the same bug.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from trainwatch.runner import run_script


@pytest.fixture(autouse=True)
def _overwrite_mode_put_back() -> Iterator[None]:
    """The scripts run in this process and turn overwrite mode on: put it back."""
    before = torch.__future__.get_overwrite_module_params_on_conversion()
    yield
    torch.__future__.set_overwrite_module_params_on_conversion(before)


# ``{convert}`` is the conversion, ``{dtype}`` the inputs' dtype after it.
CONVERTED = """
import sys
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 3))
if sys.argv[1] == "bug":
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
torch.__future__.set_overwrite_module_params_on_conversion(True)
model = model{convert}
if sys.argv[1] == "fixed":
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range(12):
    x = torch.randn(64, 12).to({dtype})
    opt.zero_grad()
    F.cross_entropy(model(x).float(), x[:, :3].argmax(1)).backward()
    opt.step()
"""

CONVERSIONS = {
    "double": (".double()", "torch.float64", "torch.float64 on cpu"),
    "to_dtype": (".to(torch.float64)", "torch.float64", "torch.float64 on cpu"),
    "half": (".half()", "torch.float16", "torch.float16 on cpu"),
    # Overwrite mode makes new Parameters even where nothing changes (over the same memory).
    "same_dtype": (".float()", "torch.float32", "torch.float32 on cpu"),
}

# A move to the GPU (run where there is one).
ON_CUDA = {"cuda": (".cuda()", '"cuda"', "torch.float32 on cuda:0")}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# A new instance of the model, converted, in place of the one the optimizer holds.
NEW_INSTANCE_CONVERTED = """
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
def net():
    return nn.Sequential(nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 3))
model = net()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
torch.__future__.set_overwrite_module_params_on_conversion(True)
model = net().double()
for step in range(12):
    x = torch.randn(64, 12, dtype=torch.float64)
    opt.zero_grad()
    F.cross_entropy(model(x), x[:, :3].argmax(1)).backward()
    opt.step()
"""

# The model called once (a shape check) before the conversion: found with the
# parameters the optimizer holds, then converted, as under tw.watch.
CALLED_BEFORE_CONVERSION = """
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 3))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
with torch.no_grad():
    model(torch.randn(2, 12))
torch.__future__.set_overwrite_module_params_on_conversion(True)
model.to(torch.float64)
for step in range(12):
    x = torch.randn(64, 12, dtype=torch.float64)
    opt.zero_grad()
    F.cross_entropy(model(x), x[:, :3].argmax(1)).backward()
    opt.step()
"""

LIGHTNING = """
import sys
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

warnings.filterwarnings("ignore")
torch.manual_seed(0)
torch.__future__.set_overwrite_module_params_on_conversion(True)


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 3))
        if sys.argv[1] == "bug":
            # Built before the Trainer converts the module to float64.
            self.opt = torch.optim.Adam(self.net.parameters(), lr=1e-3)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, index):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        if sys.argv[1] == "bug":
            return self.opt
        return torch.optim.Adam(self.parameters(), lr=1e-3)


x = torch.randn(384, 12, dtype=torch.float64)
data = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(x, x[:, :3].argmax(1)), batch_size=64
)
trainer = pl.Trainer(
    max_epochs=2,
    precision="64-true",
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Classifier(), data)
"""


def _run(tmp_path, source: str, args: list[str]) -> tuple[list[dict], int]:
    script = tmp_path / "train.py"
    script.write_text(source)
    code = run_script(script, args, log_dir=tmp_path / "log", console=False)
    assert code == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    counts = json.loads((tmp_path / "log" / "alert_counts.json").read_text())
    return [json.loads(line) for line in lines], counts["steps"]


def _script(name: str) -> str:
    convert, dtype, _ = {**CONVERSIONS, **ON_CUDA}[name]
    return CONVERTED.replace("{convert}", convert).replace("{dtype}", dtype)


def _told_as_converted(
    alerts: list[dict], target: str, names: list[str], optimizer: str = "SGD"
) -> None:
    (told,) = alerts
    assert (told["rule"], told["severity"], told["step"]) == ("not_optimized", "warning", 0)
    assert told["data"]["kind"] == "converted_in_overwrite_mode"
    assert told["data"]["optimizer_class"] == optimizer
    assert told["data"]["converted_from"] == "torch.float32 on cpu"
    assert told["data"]["converted_to"] == target
    assert sorted(told["data"]["parameters"]) == sorted(names)
    assert "set_overwrite_module_params_on_conversion(True)" in told["message"]
    assert "built before the conversion" in told["message"]
    hint = told["hint"]
    assert "build the optimizer after" in hint
    assert "set_overwrite_module_params_on_conversion(False)" in hint
    # Not the advice for a model replaced by a copy.
    assert "deepcopy" not in hint and "prepare_qat" not in hint


@pytest.mark.parametrize("conversion", list(CONVERSIONS))
def test_a_conversion_after_the_optimizer_is_told_at_the_first_step(tmp_path, conversion):
    alerts, steps = _run(tmp_path, _script(conversion), ["bug"])
    _told_as_converted(
        alerts, CONVERSIONS[conversion][2], ["0.weight", "0.bias", "2.weight", "2.bias"]
    )
    assert steps == 12


@pytest.mark.parametrize("conversion", list(CONVERSIONS))
def test_the_optimizer_built_after_the_conversion_is_silent(tmp_path, conversion):
    alerts, steps = _run(tmp_path, _script(conversion), ["fixed"])
    assert alerts == []
    assert steps == 12


@needs_cuda
@pytest.mark.parametrize("arm", ["bug", "fixed"])
def test_a_move_to_the_gpu_after_the_optimizer_is_told_at_the_first_step(tmp_path, arm):
    alerts, _ = _run(tmp_path, _script("cuda"), [arm])
    if arm == "fixed":
        assert alerts == []
    else:
        _told_as_converted(alerts, ON_CUDA["cuda"][2], ["0.weight", "0.bias", "2.weight", "2.bias"])


def test_a_new_instance_converted_in_overwrite_mode_is_still_a_replaced_model(tmp_path):
    """Its values are its own: no conversion of what the optimizer holds."""
    alerts, _ = _run(tmp_path, NEW_INSTANCE_CONVERTED, [])
    (told,) = alerts
    assert told["rule"] == "not_optimized" and told["data"]["kind"] == "replaced_model"
    assert told["step"] <= 3 and told["data"]["stale_class"] is None
    assert "copy.deepcopy" in told["hint"]


def test_a_model_called_before_its_conversion_is_told_as_under_watch(tmp_path):
    """Found holding the optimizer's parameters, then converted: each layer is told
    at the first step, as ``tw.watch`` tells it, the hint naming overwrite mode."""
    alerts, _ = _run(tmp_path, CALLED_BEFORE_CONVERSION, [])
    found = {(a["rule"], a["module"], a["step"]) for a in alerts}
    assert found == {
        ("trainable_parameters", "", 0),
        ("not_optimized", "0", 0),
        ("not_optimized", "2", 0),
    }
    told = next(a for a in alerts if a["rule"] == "not_optimized")
    assert "set_overwrite_module_params_on_conversion(True)" in told["hint"]
    assert told["data"].get("kind") != "replaced_model"


def test_under_lightning_an_optimizer_built_before_the_trainer_converts_is_told(tmp_path):
    pytest.importorskip("lightning")
    alerts, _ = _run(tmp_path, LIGHTNING, ["bug"])
    _told_as_converted(
        alerts,
        "torch.float64 on cpu",
        ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"],
        optimizer="Adam",
    )


def test_under_lightning_the_optimizer_from_configure_optimizers_is_silent(tmp_path):
    pytest.importorskip("lightning")
    alerts, steps = _run(tmp_path, LIGHTNING, ["fixed"])
    assert alerts == []
    assert steps == 12
