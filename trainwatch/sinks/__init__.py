"""Views of the same alerts: console, JSONL, memory (and TensorBoard later)."""

from trainwatch.sinks.base import AlertTally, Sink, StepNumbers, Summary
from trainwatch.sinks.console import ConsoleSink
from trainwatch.sinks.defaults import default_sinks
from trainwatch.sinks.jsonl import ALERTS_FILE, COUNTS_FILE, JsonlSink
from trainwatch.sinks.memory import MemorySink

__all__ = [
    "ALERTS_FILE",
    "COUNTS_FILE",
    "AlertTally",
    "ConsoleSink",
    "JsonlSink",
    "MemorySink",
    "Sink",
    "StepNumbers",
    "Summary",
    "default_sinks",
]
