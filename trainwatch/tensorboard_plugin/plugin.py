"""The trainwatch tab's backend: JSON routes over TensorBoard's data provider.

It reads only through ``context.data_provider`` (never the files), so it
works with the Rust data server and with the Python multiplexer alike.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from typing import Any

from tensorboard import plugin_util
from tensorboard.backend import http_util
from tensorboard.data import provider
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from trainwatch.tensorboard_plugin import metadata

_SCALARS = "scalars"
_MAX_SCALARS = 100_000


def _number(value: float) -> float | str:
    """Strict JSON for the browser: NaN and Inf travel as strings."""
    return value if math.isfinite(value) else str(value)


class TrainwatchPlugin(base_plugin.TBPlugin):
    plugin_name = metadata.PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        self._data = context.data_provider
        hints = context.sampling_hints or {}
        self._downsample = hints.get(self.plugin_name) or 100_000

    def get_plugin_apps(self) -> dict[str, Any]:
        return {
            "/index.js": self._serve_js,
            "/runs": self._serve_runs,
            "/alerts": self._serve_alerts,
            "/norms": self._serve_norms,
        }

    def is_active(self) -> bool:
        return False  # TensorBoard asks the data provider, through data_plugin_names

    def data_plugin_names(self) -> tuple[str, ...]:
        return (self.plugin_name,)

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="trainwatch")

    # -- data ------------------------------------------------------------------
    def runs(self, ctx: Any, experiment: str) -> list[str]:
        listing = self._data.list_tensors(
            ctx, experiment_id=experiment, plugin_name=self.plugin_name
        )
        return sorted(listing)

    def alerts(self, ctx: Any, experiment: str, run: str | None) -> dict[str, Any]:
        """Every alert of the run(s) and where each layer's NaN/Inf/zero streaks begin."""
        found = self._data.read_tensors(
            ctx,
            experiment_id=experiment,
            plugin_name=self.plugin_name,
            downsample=self._downsample,
            run_tag_filter=provider.RunTagFilter(runs=[run]) if run else None,
        )
        alerts: list[dict[str, Any]] = []
        marks: dict[str, list[dict[str, Any]]] = {}
        layers: dict[str, list[str]] = {}
        for run_name, tags in found.items():
            for tag, data in tags.items():
                if not tag.startswith(metadata.ALERTS_TAG):
                    continue
                for datum in data:
                    try:
                        payload = metadata.decode(datum.numpy)
                    except (ValueError, TypeError):
                        continue
                    for alert in payload.get("alerts", []):
                        alerts.append({**alert, "run": run_name})
                    for layer, kind in (payload.get("marks") or {}).items():
                        marks.setdefault(run_name, []).append(
                            {"layer": layer, "step": datum.step, "kind": kind}
                        )
                    if payload.get("layers") and run_name not in layers:
                        layers[run_name] = payload["layers"]
        alerts.sort(key=lambda a: (a["run"], a["step"], a.get("rank", 0), a["rule"]))
        _fill_repeats(alerts)
        return {"alerts": alerts, "marks": marks, "layers": layers}

    def norms(self, ctx: Any, experiment: str, run: str) -> dict[str, Any]:
        """Per-layer gradient norms of one run as rows of a heatmap (layers by steps)."""
        listing = self._data.list_scalars(
            ctx,
            experiment_id=experiment,
            plugin_name=_SCALARS,
            run_tag_filter=provider.RunTagFilter(runs=[run]),
        )
        tags = [t for t in listing.get(run, {}) if metadata.layer_of_tag(t) is not None]
        if not tags:
            return {"run": run, "layers": [], "steps": [], "values": []}
        series = self._data.read_scalars(
            ctx,
            experiment_id=experiment,
            plugin_name=_SCALARS,
            downsample=_MAX_SCALARS,
            run_tag_filter=provider.RunTagFilter(runs=[run], tags=tags),
        ).get(run, {})
        steps = sorted({d.step for data in series.values() for d in data})
        column = {step: i for i, step in enumerate(steps)}
        layers, values = [], []
        for tag in tags:
            row: list[float | str | None] = [None] * len(steps)
            for datum in series.get(tag, []):
                row[column[datum.step]] = _number(datum.value)
            layers.append(metadata.layer_of_tag(tag))
            values.append(row)
        return {"run": run, "layers": layers, "steps": steps, "values": values}

    # -- routes ------------------------------------------------------------------
    @wrappers.Request.application
    def _serve_js(self, request: wrappers.Request) -> wrappers.Response:
        body = resources.files("trainwatch.tensorboard_plugin").joinpath("static/index.js")
        return http_util.Respond(request, body.read_bytes(), "text/javascript")

    @wrappers.Request.application
    def _serve_runs(self, request: wrappers.Request) -> wrappers.Response:
        ctx = plugin_util.context(request.environ)
        experiment = plugin_util.experiment_id(request.environ)
        return _json(request, {"runs": self.runs(ctx, experiment)})

    @wrappers.Request.application
    def _serve_alerts(self, request: wrappers.Request) -> wrappers.Response:
        ctx = plugin_util.context(request.environ)
        experiment = plugin_util.experiment_id(request.environ)
        run = request.args.get("run") or None
        return _json(request, self.alerts(ctx, experiment, run))

    @wrappers.Request.application
    def _serve_norms(self, request: wrappers.Request) -> wrappers.Response:
        ctx = plugin_util.context(request.environ)
        experiment = plugin_util.experiment_id(request.environ)
        run = request.args.get("run")
        if not run:
            return http_util.Respond(request, "run is required", "text/plain", code=400)
        return _json(request, self.norms(ctx, experiment, run))


def _json(request: wrappers.Request, body: dict[str, Any]) -> wrappers.Response:
    text = json.dumps(body, allow_nan=False, default=str)
    return http_util.Respond(request, text, "application/json")


def _fill_repeats(alerts: list[dict[str, Any]]) -> None:
    """Repeats are stored as key, step and count: give them their finding's words."""
    first: dict[tuple[Any, ...], dict[str, Any]] = {}
    for alert in alerts:
        key = (alert["run"], alert.get("rank", 0), alert["rule"], alert.get("module"))
        if "message" in alert:
            first.setdefault(key, alert)
        elif key in first:
            for field in ("message", "hint", "data"):
                alert.setdefault(field, first[key].get(field))
