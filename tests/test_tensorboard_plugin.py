"""The trainwatch tab: backend over TensorBoard's data provider, a real server, a real browser."""

from __future__ import annotations

import argparse
import io
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from tensorboard import context as tb_context
from tensorboard.backend.event_processing import data_provider as tb_data_provider
from tensorboard.backend.event_processing import plugin_event_multiplexer
from tensorboard.plugins import base_plugin

import trainwatch as tw
from tests.conftest import TinyNet, train
from trainwatch.tensorboard_plugin.loader import SAMPLES_KEPT, TrainwatchLoader
from trainwatch.tensorboard_plugin.plugin import TrainwatchPlugin

PLANTED_STEPS = 130  # more alert steps than TensorBoard keeps by default (100)
NAN_STEP = 120  # late: NaN gradients end what the accumulation check can see
LAST_ALERT = NAN_STEP + 1  # the layers not yet NaN are still seen re-applied once more
LONG_STEPS = 300  # more steps than the heatmap has columns (240): several steps per cell
ZERO_STEP = 150  # the one step of the long run whose head gradient is exactly zero
CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None
)


CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _run(log_dir: Path, *, planted: bool) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def nan_in_head(step: int) -> None:
        if planted and step == NAN_STEP:
            model.head.weight.grad[0, 0] = float("nan")

    with tw.watch(model, opt, log_dir=log_dir, console=io.StringIO()):
        # planted: zero_grad dropped from step 3 on, and a NaN in head's gradient
        train(
            model,
            opt,
            PLANTED_STEPS if planted else 20,
            zero_grad_until=3 if planted else None,
            before_step=nan_in_head,
        )


def _long_run(log_dir: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def zero_head_once(step: int) -> None:
        if step == ZERO_STEP:
            model.head.weight.grad.zero_()
            model.head.bias.grad.zero_()

    with tw.watch(model, opt, log_dir=log_dir, console=io.StringIO()):
        train(model, opt, LONG_STEPS, before_step=zero_head_once)


def _lightning_run(root: Path) -> None:
    """What a Lightning user gets from one callback: a frozen layer left in the optimizer."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    from tests.lightning_models import BoringNet
    from trainwatch.lightning import TrainWatchCallback

    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=8,
        logger=TensorBoardLogger(str(root), name="lightning", version="fit"),
        callbacks=[TrainWatchCallback(console=False)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(BoringNet(freeze_fc1=True))


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tb")
    _run(root / "planted", planted=True)
    _run(root / "clean", planted=False)
    _long_run(root / "long")
    _lightning_run(root)
    return root


def _plugin(logdir: Path) -> TrainwatchPlugin:
    """The plugin over TensorBoard's own data provider, as the loader sets it up."""
    flags = argparse.Namespace(samples_per_plugin={})
    TrainwatchLoader().fix_flags(flags)
    multiplexer = plugin_event_multiplexer.EventMultiplexer(
        tensor_size_guidance=flags.samples_per_plugin
    )
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    provider = tb_data_provider.MultiplexerDataProvider(multiplexer, str(logdir))
    context = base_plugin.TBContext(data_provider=provider, sampling_hints=flags.samples_per_plugin)
    return TrainwatchPlugin(context)


# -- backend, no server -------------------------------------------------------


def test_loader_raises_the_sample_limit_but_keeps_the_users(logdir):
    flags = argparse.Namespace(samples_per_plugin={})
    TrainwatchLoader().fix_flags(flags)
    assert flags.samples_per_plugin == {"trainwatch": SAMPLES_KEPT}
    mine = argparse.Namespace(samples_per_plugin={"trainwatch": 7})
    TrainwatchLoader().fix_flags(mine)
    assert mine.samples_per_plugin == {"trainwatch": 7}


def test_backend_lists_every_watched_run_and_the_planted_alerts(logdir):
    plugin = _plugin(logdir)
    ctx = tb_context.RequestContext()
    assert plugin.runs(ctx, "") == ["clean", "lightning/fit", "long", "planted"]
    found = plugin.alerts(ctx, "", None)
    planted = [a for a in found["alerts"] if a["run"] == "planted"]
    assert {a["rule"] for a in planted} == {"accumulated_gradient", "nonfinite_backward"}
    nan = [a for a in planted if a["rule"] == "nonfinite_backward"]
    assert [(a["step"], a["module"]) for a in nan] == [(NAN_STEP, "head")]
    accumulated = [a for a in planted if a["rule"] == "accumulated_gradient"]
    # every alert step is kept: more than TensorBoard's default 100
    assert [a["step"] for a in accumulated] == list(range(3, LAST_ALERT + 1))
    assert not [a for a in found["alerts"] if a["run"] in ("clean", "long")]
    lightning = [(a["rule"], a["module"], a["step"]) for a in found["alerts"] if "fit" in a["run"]]
    assert lightning == [("frozen_in_optimizer", "fc1", 0)]
    assert {"layer": "head", "step": NAN_STEP, "kind": "nan"} in found["marks"]["planted"]
    assert "clean" not in found["marks"]
    assert found["layers"]["clean"] == found["layers"]["planted"] == ["fc1", "fc2", "head"]
    assert found["marks"]["long"] == [{"layer": "head", "step": ZERO_STEP, "kind": "zero"}]


def test_backend_norms_are_a_layers_by_steps_grid_with_nan_kept(logdir):
    plugin = _plugin(logdir)
    grid = plugin.norms(tb_context.RequestContext(), "", "planted")
    assert sorted(grid["layers"]) == ["fc1", "fc2", "head"]
    head = grid["values"][grid["layers"].index("head")]
    assert len(head) == len(grid["steps"]) == PLANTED_STEPS
    assert head[NAN_STEP] == "nan" and all(isinstance(v, float) for v in head[:NAN_STEP])
    json.dumps(grid, allow_nan=False)  # strict JSON for the browser
    clean = plugin.norms(tb_context.RequestContext(), "", "clean")
    assert all(isinstance(v, float) and v > 0 for row in clean["values"] for v in row)


# -- a real TensorBoard and a real browser --------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def tensorboard_url(logdir, tmp_path_factory):
    port = _free_port()
    log = (tmp_path_factory.mktemp("tblog") / "tensorboard.log").open("w")
    tensorboard = Path(sys.executable).with_name("tensorboard")
    process = subprocess.Popen(
        [str(tensorboard), "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        # The data server loads asynchronously: wait until the tab is active.
        for _ in range(240):
            try:
                listing = _get(f"{url}/data/plugins_listing")
                if listing.get("trainwatch", {}).get("enabled"):
                    break
            except OSError:
                pass
            if process.poll() is not None:
                pytest.fail(f"tensorboard exited: {Path(log.name).read_text()[-2000:]}")
            time.sleep(0.5)
        else:
            pytest.fail("the trainwatch plugin never became active")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


@pytest.mark.slow
def test_tensorboard_serves_the_tab_and_keeps_every_alert_step(tensorboard_url):
    listing = _get(f"{tensorboard_url}/data/plugins_listing")["trainwatch"]
    assert listing["loading_mechanism"]["module_path"].endswith("/trainwatch/index.js")
    found = _get(f"{tensorboard_url}/data/plugin/trainwatch/alerts?run=planted")
    accumulated = [a for a in found["alerts"] if a["rule"] == "accumulated_gradient"]
    assert [a["step"] for a in accumulated] == list(range(3, LAST_ALERT + 1))


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_browser_shows_the_planted_alert_row_and_the_nan_in_the_heatmap(tensorboard_url, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{tensorboard_url}/#trainwatch")
            tab = page.frame_locator("iframe")
            row = tab.locator("tr.alert-row[data-rule='accumulated_gradient']")
            row.first.wait_for(timeout=60_000)
            # One row per (run, rank, rule, module): first step 3, fired on every step after.
            assert row.count() == 1
            cells = row.first.locator("td").all_inner_texts()
            assert cells[:6] == [
                "planted",
                "3",
                str(LAST_ALERT),
                "0",
                "ERROR",  # as shown: the severity cell is upper-cased
                "accumulated_gradient",
            ]
            assert "zero_grad() is missing" in cells[7] and "zero_grad()" in cells[8]
            planted = tab.locator(".heatmap-section[data-run='planted']")
            assert planted.locator("rect.cell-nan[data-layer='head']").count() >= 1
            assert planted.locator("rect.cell").count() >= 3 * 100
            assert planted.locator("rect.alert-tick").count() == LAST_ALERT - 2  # steps 3..121
            clean = tab.locator(".heatmap-section[data-run='clean']")
            assert clean.locator("rect.cell-nan").count() == 0
            assert clean.locator("rect.cell-value").count() == 3 * 20
            assert clean.locator("rect.alert-tick").count() == 0
            # 300 steps in fewer columns: the single zero step still marks its cell.
            long = tab.locator(".heatmap-section[data-run='long']")
            columns = long.locator("rect.cell[data-layer='head']").count()
            assert columns < LONG_STEPS
            assert long.locator("rect.cell-zero").count() == 1
            assert long.locator("rect.cell-zero").get_attribute("data-layer") == "head"
            # The Lightning run's alert, written through the TensorBoardLogger's writer.
            frozen = tab.locator("tr.alert-row[data-rule='frozen_in_optimizer']")
            assert frozen.count() == 1
            assert frozen.locator("td").all_inner_texts()[:7] == [
                "lightning/fit",
                "0",
                "0",
                "0",
                "WARNING",
                "frozen_in_optimizer",
                "fc1",
            ]
            shot = tmp_path / "trainwatch_tab.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}")

            # Filters: the clean run alone has no alerts; hiding errors hides the row.
            tab.locator("select.run-select").select_option("clean")
            tab.locator("text=no alerts for this selection").wait_for(timeout=30_000)
            tab.locator("select.run-select").select_option("")
            row.first.wait_for(timeout=30_000)
            tab.locator("input.sev-error").uncheck()
            assert row.count() == 0
            assert errors == []
        finally:
            browser.close()


def test_repeats_stored_as_counts_get_their_findings_words_in_the_tab():
    from trainwatch.tensorboard_plugin.plugin import _fill_repeats

    first = {"run": "r", "rule": "zero_gradient", "module": "fc1", "step": 0, "count": 1}
    first.update(message="fc1.weight got no gradient", hint="look for a .detach()", data={})
    repeat = {"run": "r", "rule": "zero_gradient", "module": "fc1", "step": 5, "count": 6}
    other_run = {"run": "s", "rule": "zero_gradient", "module": "fc1", "step": 5, "count": 2}
    alerts = [first, repeat, other_run]
    _fill_repeats(alerts)
    assert repeat["message"] == first["message"] and repeat["hint"] == first["hint"]
    assert "message" not in other_run  # never another run's words
