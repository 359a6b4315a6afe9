"""The ``tensorboard_plugins`` entry point: loads the trainwatch tab.

A loader rather than the plugin class itself, for two reasons: TensorBoard
imports this module even when it never shows the tab, so it stays free of
werkzeug and numpy; and ``fix_flags`` raises the number of trainwatch
samples TensorBoard keeps per tag (its default for unknown plugins keeps 100,
which would drop most alerts of a long run). A value the user set with
``--samples_per_plugin trainwatch=N`` is left alone.
"""

from __future__ import annotations

from typing import Any

from tensorboard.plugins import base_plugin

from trainwatch.tensorboard_plugin.metadata import PLUGIN_NAME

# Steps with alerts (or a NaN/zero streak starting) per run and tag. Never 0:
# TensorBoard reads 0 as "keep nothing".
SAMPLES_KEPT = 100_000


class TrainwatchLoader(base_plugin.TBLoader):
    def fix_flags(self, flags: Any) -> None:
        samples = getattr(flags, "samples_per_plugin", None)
        if isinstance(samples, dict):
            samples.setdefault(PLUGIN_NAME, SAMPLES_KEPT)

    def load(self, context: base_plugin.TBContext) -> base_plugin.TBPlugin | None:
        from trainwatch.tensorboard_plugin.plugin import TrainwatchPlugin

        return TrainwatchPlugin(context)
