"""trainwatch: catches silent PyTorch training bugs while the model trains."""

from trainwatch.alert import Alert
from trainwatch.config import Config, load_config
from trainwatch.errors import ConfigError, TrainingHealthError, WatchError
from trainwatch.monitor import Monitor
from trainwatch.watching import watch

__version__ = "0.1.0"

__all__ = [
    "Alert",
    "Config",
    "ConfigError",
    "Monitor",
    "TrainingHealthError",
    "WatchError",
    "__version__",
    "load_config",
    "watch",
]
