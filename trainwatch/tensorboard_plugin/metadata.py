"""What the sink writes and the plugin reads: one place, so the two cannot drift.

Every step that had alerts (or the first step of a layer's NaN/Inf or
all-zero gradient streak) gets one string tensor holding JSON: TensorBoard
keeps one value per run, tag and step, so a step's alerts travel together.
"""

from __future__ import annotations

import json
from typing import Any

from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

PLUGIN_NAME = "trainwatch"
VERSION = 1

ALERTS_TAG = "trainwatch/alerts"  # the plugin's own tensors, one per step
TABLE_TAG = "trainwatch/alerts_table"  # markdown for the built-in Text tab
SETUP_TAG = "trainwatch/setup"  # the trainable-parameter audit, markdown for the Text tab
NORM_PREFIX = "trainwatch/grad_norm/"
TOTAL_TAG = NORM_PREFIX + "total"
HISTOGRAM_TAG = "trainwatch/grad_norm_histogram"
# Per-layer ||dW|| / ||W|| of an update, written on stalled_training's sampled steps.
UPDATE_RATIO_PREFIX = "trainwatch/update_ratio/"
# The output's move on the first batch over its spread (stalled_training), same steps.
OUTPUT_CHANGE_TAG = "trainwatch/first_batch_change"
ROOT_LABEL = "<model>"


def rank_suffix(rank: int) -> str:
    """Rank zero keeps the plain tags; alerts gathered from rank r get ``/rank<r>``."""
    return "" if rank == 0 else f"/rank{rank}"


def norm_tag(layer: str) -> str:
    name = layer if layer else ROOT_LABEL
    if name == "total":  # a layer literally named "total" must not hide the total
        name = "total (layer)"
    return NORM_PREFIX + name


def layer_of_tag(tag: str) -> str | None:
    """The layer a norm tag belongs to; None for the total and foreign tags."""
    if not tag.startswith(NORM_PREFIX) or tag == TOTAL_TAG:
        return None
    name = tag[len(NORM_PREFIX) :]
    return "total" if name == "total (layer)" else name


def summary_metadata() -> summary_pb2.SummaryMetadata:
    content = json.dumps({"version": VERSION, "kind": "alerts"}).encode()
    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name=PLUGIN_NAME, content=content
        ),
        data_class=summary_pb2.DATA_CLASS_TENSOR,
    )


def step_summary(tag: str, payload: dict[str, Any]) -> summary_pb2.Summary:
    """One step's alerts and marks as a scalar string tensor under ``tag``."""
    tensor = tensor_pb2.TensorProto(
        dtype=types_pb2.DT_STRING,
        tensor_shape=tensor_shape_pb2.TensorShapeProto(),
        string_val=[json.dumps(payload, default=str, allow_nan=False).encode()],
    )
    value = summary_pb2.Summary.Value(tag=tag, metadata=summary_metadata(), tensor=tensor)
    return summary_pb2.Summary(value=[value])


def decode(value: Any) -> dict[str, Any]:
    """The payload back from what the data provider returns (a numpy scalar of bytes)."""
    raw = value.item() if hasattr(value, "item") else value
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8")
    return json.loads(raw)
