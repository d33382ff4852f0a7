"""Exceptions raised by raygym."""


class ConfigError(ValueError):
    """A user mistake in a configuration: names the field, the value and the fix.

    >>> raise ConfigError("rollout_batch_size=0: must be a positive int; set --rollout-batch-size 16")
    Traceback (most recent call last):
    ...
    raygym.errors.ConfigError: rollout_batch_size=0: must be a positive int; set --rollout-batch-size 16
    """


class RaygymError(RuntimeError):
    """A failure at run time (an actor died, a sync failed verification, a timeout)."""


class WeightSyncError(RaygymError):
    """Weight synchronisation failed: a peer did not join, a transfer timed out or checksums differ."""
