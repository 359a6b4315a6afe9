"""trainwatch: catches silent PyTorch training bugs while the model trains."""

import random as _random

# rich draws from Python's random generator as it is imported (rich.style's
# id counter): a script that seeds before importing trainwatch must draw
# the same numbers as without it.
_seeded = _random.getstate()
try:
    from trainwatch.alert import Alert
    from trainwatch.config import Config, load_config
    from trainwatch.errors import ConfigError, TrainingHealthError, WatchError
    from trainwatch.monitor import Monitor
    from trainwatch.watching import watch
finally:
    _random.setstate(_seeded)
    del _seeded

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
